"""Asynchronous save: stage this rank's share in memory, upload and commit in the background.

On the training thread, :meth:`AsyncSaver.save_async`:

1. agrees with all ranks (one small gather on the ``control`` group) on the
   step, the state layout, a fresh directory token, and whether anyone is
   still uploading the previous save — if so, every rank skips together and
   the skip is logged (the caller may retry at a later step: coalescing);
2. stages only the keys this rank owns into reusable CPU buffers;
3. returns a :class:`SaveJob` handle.

On the upload thread: DCP writes every rank's share in parallel into
``<root>/step-<step>-<token>/`` through :class:`ChecksummingWriter`; object
sizes and checksums are gathered to rank 0, which writes the manifest last
(the commit), tells every rank the outcome, and then applies retention.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from checkpoint import dcp_calls
from checkpoint.api import (
    DEFAULT_SAVE_TIMEOUT,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointStorageError,
    CheckpointTimeoutError,
    CommitFence,
    Manifest,
    ObjectEntry,
    SaveStatus,
)
from checkpoint.commit import new_token, step_dir_name, write_manifest
from checkpoint.dcp_errors import describe
from checkpoint.flat_state import (
    FlatState,
    assign_owners,
    layout_digest,
    owned_keys,
    replicated_sizes,
)
from checkpoint.fsspec_storage import ChecksummingWriter, Location
from checkpoint.groups import Coordination
from checkpoint.retention import apply_retention
from checkpoint.staging import Stager

log = logging.getLogger(__name__)


class SaveJob:
    """Handle of one asynchronous save (implements :class:`~checkpoint.api.SaveHandle`)."""

    def __init__(self, step: int, url: str, staging_seconds: float) -> None:
        self._step = step
        self._url = url
        self._future: Future[Manifest] = Future()
        #: Seconds the training thread was blocked (agreement + staging).
        self.staging_seconds = staging_seconds
        #: Seconds the background upload and commit took, once done.
        self.upload_seconds: float | None = None

    @property
    def step(self) -> int:
        return self._step

    @property
    def url(self) -> str:
        return self._url

    @property
    def status(self) -> SaveStatus:
        if not self._future.done():
            return SaveStatus.STAGED
        return SaveStatus.FAILED if self._future.exception() else SaveStatus.COMMITTED

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: timedelta | None = DEFAULT_SAVE_TIMEOUT) -> Manifest:
        seconds = None if timeout is None else timeout.total_seconds()
        try:
            return self._future.result(timeout=seconds)
        except FutureTimeout as e:
            raise CheckpointTimeoutError(
                f"save of step {self._step} to {self._url} not finished after {seconds:g}s"
            ) from e
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointStorageError(
                f"save of step {self._step} to {self._url} failed: {e}"
            ) from e


@dataclass(frozen=True)
class _Agreement:
    step: int
    busy: bool
    digest: str
    token: str


class AsyncSaver:
    """Saves flat states asynchronously under a checkpoint root, one upload at a time.

    Args:
        root: checkpoint root location.
        coord: the checkpoint process groups.
        keep: committed checkpoints retained (rank 0 applies it after each commit).
        job_spec_hash: recorded in manifests.
        thread_count: writer threads per rank.
        fence: checked right before each commit (see :func:`checkpoint.commit.write_manifest`).
        run_id: this run's lineage: in each directory's token and manifest;
            retention removes only checkpoints of this lineage.
    """

    def __init__(
        self,
        root: Location,
        coord: Coordination,
        *,
        keep: int = 3,
        job_spec_hash: str = "",
        thread_count: int = 1,
        fence: CommitFence | None = None,
        run_id: str = "",
    ) -> None:
        self.root = root
        self.run_id = run_id
        self.fence = fence
        self.coord = coord
        self.keep = keep
        self.job_spec_hash = job_spec_hash
        self.thread_count = thread_count
        self._stager = Stager()
        self._inflight: SaveJob | None = None
        self._thread: threading.Thread | None = None
        #: Saves skipped because a previous one was still uploading.
        self.skipped = 0

    @property
    def inflight(self) -> SaveJob | None:
        """The save still uploading on this rank, if any."""
        job = self._inflight
        return job if job is not None and not job.done() else None

    def wait_inflight(self, timeout: timedelta = DEFAULT_SAVE_TIMEOUT) -> Manifest | None:
        """Wait for the save in flight (if any) and return its manifest."""
        job = self._inflight
        return job.wait(timeout) if job is not None else None

    def adopt_staging(self, previous: AsyncSaver) -> bool:
        """Take over ``previous``'s staging buffers when none of them can still be in use.

        A new saver per membership generation would otherwise allocate (and
        fault in) its buffers again at its first save, with the training loop
        waiting.  Buffers an upload is still reading are never shared: a save
        staged over them could commit a mix of two steps whose checksums match.

        Returns:
            True when the buffers were taken over; False when ``previous`` is
            still uploading (this saver allocates its own).
        """
        if previous.inflight is not None:
            return False
        self._stager, previous._stager = previous._stager, Stager()
        return True

    def prepare(self, flat: FlatState, writers: tuple[int, ...] | None = None) -> None:
        """Allocate staging buffers for this rank's share now, so the first save is fast too."""
        owners = assign_owners(flat, self.coord.world_size, writers)
        self._stager.allocate(flat, owned_keys(owners, self.coord.rank, writers))

    def save_async(
        self,
        step: int,
        flat: FlatState,
        samples_seen: int,
        *,
        wait_if_busy: bool = False,
        busy_timeout: timedelta = DEFAULT_SAVE_TIMEOUT,
        writers: tuple[int, ...] | None = None,
        stages: tuple[int, ...] | None = None,
    ) -> SaveJob | None:
        """Stage and start uploading; every rank must call this with the same step.

        Args:
            step: training step of ``flat``.
            flat: this rank's flat state (see :mod:`checkpoint.flat_state`).
            samples_seen: global data position, recorded in the manifest.
            wait_if_busy: wait for a save still uploading instead of skipping
                (controller commands and preemption use this), up to ``busy_timeout``.
            writers: the ranks that write replicated keys (None: all, by bytes).
            stages: per rank, its pipeline stage (None: all ranks hold the same keys).

        Returns:
            The handle, or None when the save was skipped on every rank
            because one of them was still uploading the previous save (with
            ``wait_if_busy``, only when that wait timed out).

        Raises:
            CheckpointMismatchError: ranks asked for different steps or hold
                differently shaped state.
        """
        started = time.perf_counter()
        if wait_if_busy and self.inflight is not None:
            try:
                self.wait_inflight(busy_timeout)
            except CheckpointError as e:
                log.warning("previous save failed while waiting to save step %d: %s", step, e)
        mine = _Agreement(
            step=step,
            busy=self.inflight is not None,
            digest=layout_digest(flat),
            token=new_token(self.run_id),
        )
        everyone: list[_Agreement] = self.coord.all_gather(mine, self.coord.control)
        if any(a.busy for a in everyone):
            busy = [r for r, a in enumerate(everyone) if a.busy]
            self.skipped += 1
            log.warning(
                "checkpoint at step %d skipped: ranks %s still uploading step %s "
                "(%d skipped so far); the next trigger will save instead",
                step,
                busy,
                self._inflight.step if self._inflight else "?",
                self.skipped,
            )
            return None
        steps = {a.step for a in everyone}
        if len(steps) != 1:
            raise CheckpointMismatchError(f"ranks asked to save different steps: {sorted(steps)}")
        by_stage: dict[int, set[str]] = {}
        for r, a in enumerate(everyone):
            by_stage.setdefault(stages[r] if stages else 0, set()).add(a.digest)
        if any(len(d) != 1 for d in by_stage.values()):
            raise CheckpointMismatchError(
                "ranks hold differently shaped replicated state (model/optimizer differ "
                "across data-parallel ranks); refusing to save"
            )
        directory = self.root.child(step_dir_name(step, everyone[0].token))
        if len(by_stage) == 1:
            owners = assign_owners(flat, self.coord.world_size, writers)
        else:  # pipeline stages hold different keys: each is written by a holder
            owners = self._stage_owners(flat, stages or (), writers)
        staged = self._stager.stage(flat, owned_keys(owners, self.coord.rank, writers))
        job = SaveJob(step, directory.url, time.perf_counter() - started)
        self._inflight = job
        self._thread = threading.Thread(
            target=self._upload,
            args=(job, directory, staged, samples_seen),
            name=f"ringmaster-checkpoint-upload-{step}",
            daemon=True,
        )
        self._thread.start()
        return job

    def _stage_owners(
        self, flat: FlatState, stages: tuple[int, ...], writers: tuple[int, ...] | None
    ) -> dict[str, int]:
        """Owners when the stages' keys differ: the lowest rank of each stage tells
        its replicated keys and their bytes; each key goes to a rank of a stage
        holding it."""
        rank = self.coord.rank
        first = stages.index(stages[rank]) == rank
        mine = replicated_sizes(flat) if first else None
        told: list[dict[str, int] | None] = self.coord.all_gather(mine, self.coord.control)
        holders: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for teller, keys in enumerate(told):
            if keys is None:
                continue
            ranks = [r for r, s in enumerate(stages) if s == stages[teller]]
            for key, size in keys.items():
                holders.setdefault(key, []).extend(ranks)
                sizes[key] = size
        return assign_owners(flat, self.coord.world_size, writers, holders, sizes)

    def _write(self, directory: Location, staged: dict[str, Any]) -> list[ObjectEntry]:
        writer = ChecksummingWriter(directory, thread_count=self.thread_count)
        dcp_calls.save(staged, writer, self.coord.upload if self.coord.distributed else None)
        return writer.objects()

    def _upload(
        self, job: SaveJob, directory: Location, staged: dict[str, Any], samples_seen: int
    ) -> None:
        started = time.perf_counter()
        coord = self.coord
        try:
            self._stager.wait_copied()  # device-to-host copies run on a side stream
            objects = self._write(directory, staged)
            gathered: list[list[ObjectEntry]] = coord.all_gather(objects, coord.upload)
            outcome: Manifest | str
            if coord.is_coordinator:
                manifest = Manifest(
                    step=job.step,
                    world_size=coord.world_size,
                    job_spec_hash=self.job_spec_hash,
                    created_at=time.time(),
                    objects=tuple(sorted((o for objs in gathered for o in objs), key=_by_path)),
                    samples_seen=samples_seen,
                    run_id=self.run_id,
                )
                try:
                    write_manifest(directory, manifest, self.fence)
                    outcome = manifest
                except CheckpointError as e:
                    outcome = str(e)
            else:
                outcome = ""
            outcome = coord.broadcast(outcome, coord.upload)
            if isinstance(outcome, str):
                raise CheckpointStorageError(f"commit of step {job.step} failed: {outcome}")
            job.upload_seconds = time.perf_counter() - started
            log.info(
                "checkpoint step %d committed at %s: %d objects, %.1f MiB, upload %.2fs",
                job.step,
                directory.url,
                len(outcome.objects),
                outcome.total_bytes / 2**20,
                job.upload_seconds,
            )
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            job.upload_seconds = time.perf_counter() - started
            log.error("checkpoint step %d to %s failed: %s", job.step, directory.url, describe(e))
            if coord.is_coordinator:
                discard_uncommitted(directory)
            job._future.set_exception(_as_checkpoint_error(e, job))
            if not isinstance(e, Exception) and not _is_dcp_failure(e):
                raise
            return
        if coord.is_coordinator:
            # Before the handle completes, so the next save never overlaps retention.
            try:
                apply_retention(self.root, self.keep, run_id=self.run_id)
            except (CheckpointError, OSError) as e:
                log.warning(
                    "retention under %s failed (will retry next save): %s", self.root.url, e
                )
        job._future.set_result(outcome)

    def close(self, timeout: timedelta = DEFAULT_SAVE_TIMEOUT) -> None:
        """Wait for the save in flight, then drop staging buffers."""
        try:
            self.wait_inflight(timeout)
        finally:
            if self._thread is not None:
                self._thread.join(timeout.total_seconds())
            self._stager.release()


def discard_uncommitted(directory: Location) -> bool:
    """Remove what a failed save wrote into its own ``directory`` (best effort).

    Only the coordinator writes a manifest, and it calls this after its save
    failed, so nothing commits there afterwards; a manifest already there (a
    write that reached the store although its answer did not) keeps the
    directory: a committed checkpoint is never touched here.

    Returns:
        True when the directory is gone (or was never created).
    """
    try:
        if directory.fs.exists(directory.path(MANIFEST_NAME)):
            return False
        if directory.fs.exists(directory.root):
            directory.fs.rm(directory.root, recursive=True)
    except Exception as e:  # the storage that just failed may fail this too
        log.warning("could not remove the failed save's %s: %s", directory.url, describe(e))
        return False
    return True


def _is_dcp_failure(e: BaseException) -> bool:
    return isinstance(e, CheckpointException)


def _as_checkpoint_error(e: BaseException, job: SaveJob) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    err = CheckpointStorageError(f"save of step {job.step} to {job.url} failed: {describe(e)}")
    err.__cause__ = e
    return err


def _by_path(entry: ObjectEntry) -> str:
    return entry.path
