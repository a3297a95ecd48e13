"""The one object a training runtime uses: save on triggers, restore.

Typical loop (every rank)::

    ckpt = Checkpointer(spec.checkpoint.url, keep=3, every_steps=100)
    result = ckpt.restore(state)             # newest committed checkpoint; any world size
    sampler = ElasticSampler(len(ds), rank, world, result.samples_seen)
    for step in range((result.step or 0) + 1, total + 1):
        train_one_step(...)
        state.samples_seen += batch_size * world
        ckpt.maybe_save(step, state)         # async; returns a handle or None
    ckpt.close()

Live state reaches a replacement rank from the survivors
(:mod:`agents.recovery.state_sync`), not from here: a checkpoint is for starting a job
again, after every rank is gone or on request.

Controller commands and preemption call :meth:`Checkpointer.request_save`
(from any thread or a signal handler) so that the next ``maybe_save`` saves on
every rank at the same step, or :meth:`Checkpointer.save_now` directly from
the training loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta
from typing import Any

import fsspec
import torch.distributed as dist

from checkpoint.api import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_SAVE_TIMEOUT,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointStorageError,
    CommitFence,
    Manifest,
    RestoreResult,
    RestoreSource,
    SaveInProgressError,
    TrainState,
    VerifyReport,
)
from checkpoint.async_save import AsyncSaver, SaveJob
from checkpoint.commit import latest_committed, list_checkpoints, verify_checkpoint
from checkpoint.durable import restore_durable
from checkpoint.flat_state import FlatState, apply, capture
from checkpoint.fsspec_storage import Location
from checkpoint.groups import Coordination
from checkpoint.object_state import join_tensors, live_object_targets, split_tensors
from checkpoint.optimizer_shapes import shape_from_newest
from checkpoint.retention import RetentionResult, apply_retention
from checkpoint.triggers import SaveTrigger

log = logging.getLogger(__name__)

#: Key inside ``TrainState.extra``'s saved object that holds ``TrainState.objects``' states.
OBJECTS_KEY = "__objects__"


def capture_with_objects(state: TrainState, rank: int) -> FlatState:
    """The flat state to save: :func:`capture`'s, plus ``state.objects``.

    Each object's state dict is taken apart (:func:`split_tensors`): its
    tensors become entries of their own, staged like the model's, and the
    rest goes into (a copy of) ``extra``, serialized now, so a later training
    step cannot change what an asynchronous save writes.
    """
    if not state.objects:
        return capture(state, rank)[0]
    skeletons, tensors = {}, {}
    for name, obj in state.objects.items():
        skeletons[name], own = split_tensors(name, obj.state_dict())
        tensors.update(own)
    extra = dict(state.extra)
    extra[OBJECTS_KEY] = skeletons
    flat, _ = capture(dataclasses.replace(state, extra=extra), rank)
    flat.update(tensors)
    return flat


def load_objects(state: TrainState, saved: dict[str, Any], loaded: FlatState, where: str) -> None:
    """Load ``state.objects`` from what a checkpoint's ``extra`` held (their skeletons) and
    the object entries ``loaded`` (see :func:`capture_with_objects`)."""
    states = saved.pop(OBJECTS_KEY, None) or {}
    missing = []
    for name, obj in state.objects.items():
        if name in states:
            obj.load_state_dict(join_tensors(states[name], loaded, where))
        else:
            missing.append(name)
    if missing:
        log.warning(
            "%s holds no state for %s: left as constructed (saved before they were tracked?)",
            where,
            ", ".join(repr(n) for n in missing),
        )


class Checkpointer:
    """Asynchronous durable checkpoints for one training job.

    Constructing it is collective when ``torch.distributed`` is initialised
    (it creates the checkpoint's gloo groups): every rank constructs it together.

    Args:
        url: durable checkpoint root (any fsspec URL).
        storage_options: fsspec options (``s3fs`` credentials, endpoint...).
        filesystem: an fsspec filesystem to use instead of resolving ``url``.
        keep: committed checkpoints to retain (at least 1).
        every_steps: save every N steps (0: off).
        every_seconds: save every T seconds, as measured on rank 0 (0: off).
        job_spec_hash: recorded in each manifest.
        group: training process group whose ranks save together (default: world).
        thread_count: writer threads per rank.
        collective_timeout: bound on every checkpoint collective.
        check_storage: write and delete a probe object now, so a wrong URL or
            missing credentials fail before training starts.
        fence: checked right before each commit; raises
            :class:`~checkpoint.api.CommitFencedError` when this saver no longer
            belongs to the job's current generation (the save stays uncommitted).
        run_id: the run this saver belongs to, the same in every generation
            and restart of it: recorded in each manifest, and retention
            removes only this run's checkpoints (and never another run's
            save in progress under the same root).  "": saves without a run
            id form one lineage of their own.
        restore_buffer_bytes: bytes of a checkpoint's objects a restore may
            hold in memory on this rank, so that each object it loads is read
            once (fetched whole, verified, loaded from memory) instead of
            twice (verified, then read again by DCP).  None: half of the
            memory available when the restore starts; 0: always read twice.
            On a local disk objects are mapped, not held: this limit does
            not apply there.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        filesystem: fsspec.AbstractFileSystem | None = None,
        keep: int = 3,
        every_steps: int = 0,
        every_seconds: float = 0.0,
        job_spec_hash: str = "",
        group: dist.ProcessGroup | None = None,
        thread_count: int = 1,
        collective_timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
        check_storage: bool = True,
        fence: CommitFence | None = None,
        run_id: str = "",
        restore_buffer_bytes: int | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if restore_buffer_bytes is not None and restore_buffer_bytes < 0:
            raise ValueError(
                f"restore_buffer_bytes must be 0 or more (or None), got {restore_buffer_bytes}"
            )
        self.root = Location.from_url(url, storage_options, filesystem)
        self._storage_options = storage_options
        self.coord = Coordination(group, collective_timeout)
        self.trigger = SaveTrigger(every_steps, every_seconds)
        self.keep = keep
        self.restore_buffer_bytes = restore_buffer_bytes
        self.saver = AsyncSaver(
            self.root,
            self.coord,
            keep=keep,
            job_spec_hash=job_spec_hash,
            thread_count=thread_count,
            fence=fence,
            run_id=run_id,
        )
        if check_storage:
            problem = None
            if self.coord.is_coordinator:
                try:
                    self.check_storage()
                except CheckpointStorageError as e:
                    problem = str(e)
            # Every rank fails together rather than waiting for rank 0 at a collective.
            problem = self.coord.broadcast(problem, self.coord.control)
            if problem is not None:
                raise CheckpointStorageError(problem)

    @property
    def rank(self) -> int:
        return self.coord.rank

    @property
    def world_size(self) -> int:
        return self.coord.world_size

    # ------------------------------------------------------------------ storage

    def check_storage(self) -> None:
        """Write, read and delete a probe object under the root.

        Raises:
            CheckpointStorageError: the root is unreachable or not writable.
        """
        probe = self.root.path(f".ringmaster-probe-{self.coord.rank}")
        try:
            self.root.fs.makedirs(self.root.root, exist_ok=True)
            self.root.fs.pipe_file(probe, b"ok")
            if self.root.fs.cat_file(probe) != b"ok":
                raise OSError("probe object read back differently")
            self.root.fs.rm_file(probe)
        except Exception as e:
            raise CheckpointStorageError(
                f"checkpoint storage {self.root.url} is not usable: {type(e).__name__}: {e}. "
                "Check the URL, the bucket, and credentials (environment, ~/.aws, storage options)."
            ) from e

    # ------------------------------------------------------------------ saving

    def request_save(self, reason: str = "requested") -> None:
        """Ask for a save at the next :meth:`maybe_save` (thread- and signal-safe).

        Rank 0's request decides for everyone, so a controller command only
        needs to reach rank 0; other ranks may request too.
        """
        self.trigger.request(reason)

    def _decide(self, step: int) -> str | None:
        reason = self.trigger.due(step)
        if self.coord.world_size > 1:
            # Clocks and requests are local to a rank: rank 0 decides for all
            # (one small broadcast per step on the checkpoint's control group).
            reason = self.coord.broadcast(reason, self.coord.control)
        return reason

    def maybe_save(self, step: int, state: TrainState) -> SaveJob | None:
        """Start an asynchronous save if a trigger fires at ``step`` (all ranks call).

        Returns:
            The handle of the started save, or None (no trigger, or skipped
            because the previous save is still uploading; the trigger stays
            pending so a later step saves instead).
        """
        reason = self._decide(step)
        if reason is None:
            return None
        job = self.save_async(step, state)
        if job is not None:
            log.info("checkpoint at step %d (%s)", step, reason)
            self.trigger.saved()
        else:
            self.trigger.request(reason)
        return job

    def save_async(
        self,
        step: int,
        state: TrainState,
        *,
        wait_if_busy: bool = False,
        busy_timeout: timedelta = DEFAULT_SAVE_TIMEOUT,
    ) -> SaveJob | None:
        """Stage ``state`` and upload it in the background (all ranks call, same step).

        Args:
            wait_if_busy: wait for a save still uploading (up to ``busy_timeout``)
                instead of skipping.

        Returns:
            The handle, or None when skipped because a save is still uploading.
        """
        flat = capture_with_objects(state, self.coord.rank)
        return self.saver.save_async(
            step,
            flat,
            state.samples_seen,
            wait_if_busy=wait_if_busy,
            busy_timeout=busy_timeout,
            writers=state.replica_writers,
            stages=state.stages,
        )

    def save_now(
        self,
        step: int,
        state: TrainState,
        *,
        timeout: timedelta = DEFAULT_SAVE_TIMEOUT,
        busy_timeout: timedelta = DEFAULT_SAVE_TIMEOUT,
    ) -> Manifest:
        """Save ``step`` and wait until it is committed (preemption, controller command).

        Waits for a save still in flight first (up to ``busy_timeout``: a hung
        upload does not hold this one for ever), so it is not skipped.

        Raises:
            SaveInProgressError: the save in flight did not end within ``busy_timeout``.
        """
        job = self.save_async(step, state, wait_if_busy=True, busy_timeout=busy_timeout)
        if job is None:  # another rank could not wait in time
            raise SaveInProgressError(
                f"save of step {step} was skipped: another rank is still uploading"
            )
        manifest = job.wait(timeout)
        self.trigger.saved()
        return manifest

    def prepare(self, state: TrainState) -> None:
        """Allocate staging memory for ``state`` ahead of the first save (optional).

        The first save otherwise pays for allocating and faulting in its
        buffers while the training loop waits.
        """
        flat = capture_with_objects(state, self.coord.rank)
        self.saver.prepare(flat, state.replica_writers)

    def adopt_staging(self, previous: Checkpointer) -> bool:
        """Reuse ``previous``'s staging memory (e.g. the checkpointer of the last generation).

        The first save then copies into buffers that already exist instead of
        allocating them while training waits.  Nothing is shared while
        ``previous`` still uploads; see :meth:`AsyncSaver.adopt_staging`.
        """
        return self.saver.adopt_staging(previous.saver)

    def wait(self, timeout: timedelta = DEFAULT_SAVE_TIMEOUT) -> Manifest | None:
        """Wait for the save in flight, if any."""
        return self.saver.wait_inflight(timeout)

    # ------------------------------------------------------------------ restoring

    def restore(self, state: TrainState, *, url: str | None = None) -> RestoreResult:
        """Restore ``state`` from the newest committed checkpoint that verifies (collective).

        Checkpoints that fail verification are passed over for older ones
        (listed in the result's ``skipped``); with none left, ``state`` is
        untouched and the result's source is ``NONE`` (a fresh start).

        Args:
            state: filled in place (model, optimizer, scheduler, extra, objects,
                ``samples_seen``, and this rank's ``rank_state`` + RNG when saved).
            url: a specific checkpoint directory (under this root or any
                other, read with the same storage options); it must verify,
                there is no falling back.

        Raises:
            CheckpointCorruptError: ``url`` was given and cannot be used.
        """
        if self.saver.inflight is not None:
            self.saver.wait_inflight()
        root = self.root
        if url is not None:
            parent = url.rstrip("/").rsplit("/", 1)[0]
            if parent != self.root.url:
                # A checkpoint of another root (another job, another bucket).
                root = Location.from_url(parent, self._storage_options)
        # Capturing an optimizer that has not stepped yet gives it state (torch runs a
        # step with zero gradients and lr 0); a fresh start must not keep it: Adam's
        # step count would start at 1 and change every update after it.
        unstepped = state.optimizer is not None and not state.optimizer.state
        started = time.perf_counter()
        shaping = None
        if unstepped:
            assert state.optimizer is not None
            shaping = shape_from_newest(state.model, state.optimizer, root, url)
        target, mapping = capture(state, self.coord.rank)
        target.update(live_object_targets(state.objects))  # filled in place where they fit
        seconds = {"prepare": time.perf_counter() - started}
        try:
            outcome = restore_durable(
                root,
                target,
                self.coord,
                url=url,
                budget=self.restore_buffer_bytes,
                before_load=shaping.join if shaping is not None else None,
            )
        except BaseException:
            if shaping is not None:
                shaping.join()
            if unstepped and state.optimizer is not None:
                state.optimizer.state.clear()  # shaped or stepped for the load: not the user's
            raise
        seconds.update(outcome.seconds)
        if outcome.manifest is None and url is not None:
            raise CheckpointCorruptError(
                f"the checkpoint asked for, {url}, cannot be used: {'; '.join(outcome.skipped)}"
            )
        if outcome.manifest is None:
            if unstepped and state.optimizer is not None:
                state.optimizer.state.clear()
            log.info("no usable checkpoint under %s; starting fresh", root.url)
            return RestoreResult(
                source=RestoreSource.NONE,
                step=None,
                samples_seen=state.samples_seen,
                skipped=outcome.skipped,
                seconds=seconds,
            )
        # ``extra`` is loaded into a copy first: its saved object also carries ``objects``.
        started = time.perf_counter()
        loaded = dataclasses.replace(state, extra={})
        restored_rank = apply(loaded, target, mapping, self.coord.rank)
        load_objects(state, loaded.extra, target, outcome.url or root.url)
        state.extra.clear()
        state.extra.update(loaded.extra)
        state.samples_seen = loaded.samples_seen
        seconds["apply"] = time.perf_counter() - started
        return RestoreResult(
            source=RestoreSource.DURABLE,
            step=outcome.manifest.step,
            samples_seen=state.samples_seen,
            url=outcome.url,
            rank_state_restored=restored_rank,
            skipped=outcome.skipped,
            seconds=seconds,
        )

    # ------------------------------------------------------------------ inspection

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint directory, committed or not, oldest first."""
        return list_checkpoints(self.root)

    def latest(self) -> CheckpointInfo | None:
        """Newest committed checkpoint."""
        return latest_committed(self.root)

    def verify(self, info: CheckpointInfo) -> VerifyReport:
        """Check every object of ``info`` against its manifest (this process only)."""
        return verify_checkpoint(self.root.child(info.name))

    def gc(self, *, all_uncommitted: bool = False) -> RetentionResult:
        """Apply retention now."""
        return apply_retention(
            self.root, self.keep, run_id=self.saver.run_id, all_uncommitted=all_uncommitted
        )

    def close(self, timeout: timedelta = DEFAULT_SAVE_TIMEOUT) -> None:
        """Wait for the save in flight and release staging memory."""
        self.saver.close(timeout)
