"""Durable checkpoints from the worker runtime: the glue to :mod:`checkpoint`.

Each generation gets a :class:`~checkpoint.Checkpointer` on its own process
group (creating it is collective).  A fresh job restores from the newest
committed checkpoint (or from the one a resubmitted job was given); saves
happen at step boundaries that every rank agreed on (:mod:`agents.runtime.boundary`):
on request, on stop, and periodically, every ``checkpoint.every_steps``
steps or ``checkpoint.every_seconds`` seconds (the rule is
:meth:`checkpoint.SaveTrigger.decide`; :attr:`Saving.trigger` keeps this
worker's clock of it, which starts with the job's first generation and
restarts at every save).  Rank 0 records each commit in
etcd as a :class:`~orchestrator.state.records.CheckpointRecord`, through the
generation fence, so a fenced-out process never claims a checkpoint; the
commit itself is fenced too (:meth:`Saving.check_commit`).  A save may take
``RINGMASTER_CHECKPOINT_SAVE_TIMEOUT`` (``SETTINGS.checkpoint_save_timeout``);
at the end of the job, a save still uploading gets ``checkpoint.final_wait``.

A save that fails or hangs is a storage fault, not the script's error
(:mod:`agents.runtime.storage_faults`): reported, and training goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch import nn

from agents.api import Resumed, StorageFaultError, WorkerEnv, WorkerView
from agents.messages import one_line
from agents.runtime.commit_record import record_commit
from agents.runtime.elastic_ddp import ElasticDDP
from agents.runtime.failures import peer_failure
from agents.runtime.outer_checkpoint import first_site, outer_rank_state, replicated, restore_outer
from agents.runtime.storage_faults import StorageFaults
from agents.runtime.telemetry import WorkerTelemetry
from agents.state.sharding import ShardedModel
from orchestrator.api import EtcdError
from orchestrator.settings import SETTINGS
from orchestrator.state import keys
from orchestrator.state.api import FencedError
from orchestrator.state.fencing import GenerationFence
from orchestrator.state.records import CheckpointRecord

if TYPE_CHECKING:
    from checkpoint import TrainState
    from checkpoint.triggers import SaveTrigger
    from orchestrator.etcd.client import EtcdClient
    from orchestrator.spec.job import JobSpec

__all__ = ["HOOK_STATE", "Saving"]

log = logging.getLogger("ringmaster.worker")

#: Key of the comm hook's state in a checkpoint's per-rank state.
HOOK_STATE = "comm_hook"

#: Tracked names that fill a ``TrainState`` field of their own (the rest go to ``objects``).
_OWN_FIELDS = ("model", "optimizer", "scheduler")


class Saving:
    """One worker's checkpointer, its pending save and its periodic schedule.

    Args:
        env: the worker's environment (its job).
        client: the worker's etcd client (resume requests).
        spec: the job's spec (its ``checkpoint`` section).
        fence: the generation fence: commits and records go through it.
        telemetry: records how long saves blocked and uploaded.
        held: the worker (its step, rank, tracked objects and comm hook).
    """

    def __init__(
        self,
        env: WorkerEnv,
        client: EtcdClient,
        spec: JobSpec,
        fence: GenerationFence,
        telemetry: WorkerTelemetry,
        held: WorkerView,
    ) -> None:
        self._env = env
        self._client = client
        self._spec = spec
        self._fence = fence
        self._telemetry = telemetry
        self._held = held
        self._ckpt: Any = None
        self._pending: Any = None
        #: when the pending save started: ``time.monotonic()`` and wall-clock time
        self._pending_since = (0.0, 0.0)
        self.faults = StorageFaults(
            client,
            env.job,
            keys.worker_id(env.node, env.local_rank),
            spec.checkpoint,
            lambda: held.rank,
        )
        self._commit_refused: str | None = None
        self._before_save: Callable[[str], None] | None = None
        #: comm hook state restored from a checkpoint, for the next hook built
        self._hook_resume: dict[str, Any] | None = None
        self._trigger: SaveTrigger | None = None
        self._lineage_id: str | None = None

    @property
    def trigger(self) -> SaveTrigger:
        """When a save is due: the step boundary decides with it (its vote agrees on the
        clock).  Exists once the first generation opened its checkpointer."""
        assert self._trigger is not None, "no generation was joined yet"
        return self._trigger

    @property
    def url(self) -> str:
        """Where the job's durable checkpoints go (``checkpoint.url``)."""
        return self._spec.checkpoint.url

    def call_before_save(self, fn: Callable[[str], None] | None) -> None:
        """Call ``fn(reason)`` on every rank before each save (the script's ``on_save``)."""
        self._before_save = fn

    def take_hook_state(self) -> dict[str, Any] | None:
        """The comm hook state a resume restored, once (the next hook built loads it)."""
        state, self._hook_resume = self._hook_resume, None
        return state

    def _lineage(self) -> str:
        """The checkpoints' lineage: the job and when its first run was submitted.

        A resumed run continues its job's lineage (its retention may remove what
        earlier runs saved); another job of the same name (a second ``ringmaster
        run`` with an etcd of its own) is another lineage, whose checkpoints this
        one's retention never touches.
        """
        if self._lineage_id is None:
            from orchestrator.state.runs import lineage_id

            self._lineage_id = lineage_id(self._client, self._env.job)
        return self._lineage_id

    # -- per generation ----------------------------------------------------------------

    def open(self, first: bool) -> None:
        """A checkpointer on this generation's group (creating it is collective)."""
        from checkpoint import Checkpointer, SaveTrigger
        from checkpoint.api import CheckpointStorageError
        from orchestrator.state.jobs import checkpoint_hash

        previous = self._ckpt
        self._ckpt = None
        job, self._pending = self._pending, None
        if job is not None and job.done():  # one still uploading is left behind
            self._settle(job, count=False)
        cfg = self._spec.checkpoint
        url = cfg.url if "://" in cfg.url else f"file://{os.path.abspath(cfg.url)}"
        # The runtime's checkpointer has no schedule of its own: its ranks vote on
        # when a save is due (agents.runtime.boundary), by ``self.trigger``'s rule.
        try:
            self._ckpt = Checkpointer(
                url,
                keep=cfg.keep,
                job_spec_hash=checkpoint_hash(self._spec),
                check_storage=first,
                fence=self.check_commit,
                run_id=self._lineage(),
            )
        except CheckpointStorageError as e:  # the probe failed: no save could ever commit
            raise StorageFaultError(
                f"{e} No checkpoint can be saved: fix checkpoint.url, then run the job again"
            ) from e
        if previous is None:
            self._trigger = SaveTrigger.from_spec(cfg)  # the periodic clock starts with training
        else:
            # Same model, and usually the same share: the first save of this
            # generation then copies into existing buffers instead of allocating.
            self._ckpt.adopt_staging(previous)

    def check_commit(self) -> None:
        """Commit fence for durable checkpoints: only a current member commits."""
        from checkpoint.api import CommitFencedError

        try:
            self._fence.check()
        except FencedError as e:
            self._commit_refused = str(e)
            raise CommitFencedError(f"checkpoint not committed: {e}") from e

    def can_resume(self) -> bool:
        """A ``model`` is tracked: there is a checkpoint's state to restore into."""
        return self.train_state() is not None

    def train_state(self) -> TrainState | None:
        """Everything tracked as a ``TrainState`` (None without a tracked ``model``).

        ``model``, ``optimizer`` and ``scheduler`` fill their own fields; every
        other tracked object (a ``GradScaler``, more LR schedulers, EMA weights,
        counters, DCP ``Stateful`` objects) goes into ``objects`` under its name,
        so a resume from a durable checkpoint brings back all that a
        replacement receives from a live peer.
        """
        from checkpoint import TrainState

        held = self._held
        model = held.tracked.get("model")
        stages = model.rank_stages() if isinstance(model, ShardedModel) else None
        if isinstance(model, ElasticDDP | ShardedModel):
            # the plain (or the fully_shard-ed) module: checkpoints load without ringmaster
            model = model.module
        if not isinstance(model, nn.Module):
            return None
        rank_state = outer_rank_state(held.tracked.get("outer"))  # fsdp in each site: its slice's
        if held.hook is not None:  # per rank: residuals, PowerSGD factors, its RNG
            rank_state[HOOK_STATE] = {
                "world_size": held.world_size,
                "state": held.hook.state_dict(),
            }
        return TrainState(
            model=model,
            optimizer=held.tracked.get("optimizer"),  # type: ignore[arg-type]
            scheduler=held.tracked.get("scheduler"),
            samples_seen=held.step,
            rank_state=rank_state,
            objects=replicated(held.tracked, _OWN_FIELDS),
            replica_writers=first_site(held.tracked.get("outer")),
            stages=stages,
        )

    def resume(self, world_size: int) -> Resumed | None:
        """Restore the newest durable state, if there is one (every rank, collectively).

        Args:
            world_size: the world size of the generation that resumes.

        Returns:
            The checkpoint loaded, or None (there is none: a fresh start).
        """
        from checkpoint.api import CheckpointCorruptError, CheckpointNotFoundError
        from orchestrator.state.jobs import read_resume

        client, job = self._client, self._env.job
        # A resubmitted job (`ringmaster resume`, `run --from`) starts from the checkpoint
        # it was given, until it has committed one of its own; every rank reads the same
        # records, as no save can happen before all ranks have restored.
        request = read_resume(client, job)
        if request is not None and client.get(keys.job_checkpoint(job)) is None:
            url: str | None = request.url
        else:
            url = None
        state = self.train_state()
        assert state is not None, "resume() without a tracked model (see can_resume)"
        try:
            result = self._ckpt.restore(state, url=url)
        except CheckpointCorruptError as e:
            if request is None or not request.newest or not _under(url, self.url):
                raise self._unusable(e) from e
            # `--resume` asked for this root's newest: the next one that verifies serves
            self.faults.passed_over(str(url), one_line(e), self._ckpt.coord.rank)
            result = self._ckpt.restore(state)
        except CheckpointNotFoundError as e:  # the one asked for
            raise self._unusable(e) from e
        self._hook_resume = _saved_hook_state(state.rank_state.get(HOOK_STATE), world_size)
        restore_outer(self._held.tracked.get("outer"), state.rank_state)
        if result.step is None:
            return None
        log.warning("resumed from %s at step %d", result.url, result.step)
        self.faults.committed(int(result.step), str(result.url))
        return Resumed(int(result.step), result.url)

    def _unusable(self, e: BaseException) -> StorageFaultError:
        """A checkpoint asked for by a resume that cannot be used, as the job's fault."""
        return StorageFaultError(
            f"{one_line(e)}: resuming from it would fail the same way; run the job from an "
            f"older checkpoint (`ringmaster checkpoints list {self.url}`, then "
            "`ringmaster run --from URL`) or without --resume/--from",
            fault="checkpoint",
        )

    # -- saving ------------------------------------------------------------------------

    def save(self, reason: str) -> None:
        """Save now (every rank at the same boundary): periodic saves may run async."""
        self.trigger.saved()  # the clock restarts with any save, as it starts
        if self._before_save is not None:
            self._before_save(reason)
        state = self.train_state()
        if self._ckpt is None or state is None:
            return
        started = time.perf_counter()
        step = self._held.step
        if reason == "periodic" and self._spec.checkpoint.async_:
            pending = self._pending
            job = self._ckpt.save_async(step, state)
            self._telemetry.checkpoint_blocked(time.perf_counter() - started)
            if job is not None:  # no rank was still uploading: each takes the last outcome
                self._pending, self._pending_since = job, (time.monotonic(), time.time())
                if pending is not None:
                    self._settle(pending)
            elif pending is not None and self._pending_age() >= self._busy().total_seconds():
                # skipped behind a save uploading longer than the end of the job would wait
                self.faults.stalled(pending.step, self._pending_age(), step)
            return
        try:
            manifest = self._ckpt.save_now(
                step, state, timeout=SETTINGS.checkpoint_save_timeout, busy_timeout=self._busy()
            )
        except Exception as e:
            self._telemetry.checkpoint_failed(time.perf_counter() - started)
            self._save_failed(step, e)
            return
        self._telemetry.checkpoint_blocked(time.perf_counter() - started)
        self._telemetry.checkpoint_uploaded(time.perf_counter() - started)
        self.poll()  # the save before it ended on every rank (it was waited for): first
        self._record(manifest.step, reason)

    def unsettled(self) -> bool:
        """An asynchronous save is still uploading (the step boundary's vote asks)."""
        return self._pending is not None and not self._pending.done()

    def poll(self) -> None:
        """Take the pending async save's outcome once it ended: record it, or count its
        failure.  Called where every rank's save has ended (a vote said so, or a new
        save started: :meth:`save`), so that every rank counts it at the same boundary.
        """
        job = self._pending
        if job is not None and job.done():
            self._pending = None
            self._settle(job)

    def _settle(self, job: Any, count: bool = True) -> None:
        """Record the ended async save ``job``, or count its failure (``count``; else
        log it: the ranks of a generation that ended may not have seen the same end)."""
        try:
            manifest = job.wait(SETTINGS.checkpoint_save_timeout)
        except Exception as e:
            if count:
                self._save_failed(job.step, e)
            else:
                log.warning("checkpoint of step %d failed: %s", job.step, one_line(e))
            return
        self._telemetry.checkpoint_uploaded(getattr(job, "upload_seconds", None))
        self._record(manifest.step, "periodic", job.url)

    def uploading(self) -> tuple[int, float] | None:
        """``(step, wall-clock start)`` of the save still uploading, if any (for progress)."""
        job = self._pending
        if job is None or job.done():
            return None
        return job.step, self._pending_since[1]

    def _pending_age(self) -> float:
        return time.monotonic() - self._pending_since[0]

    def _busy(self) -> timedelta:
        """How long a save waits for the previous one still uploading: as the end does."""
        return self._spec.checkpoint.final_wait

    def _save_failed(self, step: int, e: Exception) -> None:
        """A save failed: a storage fault is reported and training goes on.

        Raises:
            Exception: ``e`` itself when a peer's failure broke the save (the
                step boundary recovers) or it is not the storage's (the script's
                state differs across ranks).
            StorageFaultError: the job's ``checkpoint.max_consecutive_failures`` is reached.
        """
        from checkpoint.api import RetryableCheckpointError

        if self._refused_commit(e):
            return
        if not isinstance(e, RetryableCheckpointError) or peer_failure(e, None, None):
            raise e
        self.faults.failed(step, e)

    def _refused_commit(self, e: BaseException) -> bool:
        """True (and logged) when a save failed because the commit fence refused it."""
        refused, self._commit_refused = self._commit_refused, None
        if refused is None:
            return False
        log.warning("%s (%s)", refused, one_line(e))
        return True

    def _record(self, step: int, reason: str, where: str | None = None) -> None:
        url = self._spec.checkpoint.url
        self.faults.committed(step, where or url)
        if self._held.rank != 0:
            return
        record = CheckpointRecord(url=url, step=step, reason=reason, at=time.time())
        try:
            record_commit(self._fence, self._env.job, record)
        except (FencedError, EtcdError) as e:
            log.warning("checkpoint of step %d not recorded: %s", step, e)

    def close(self) -> None:
        """Wait for the pending save (and record it), then close the checkpointer.

        The job has ended: a save still uploading gets ``checkpoint.final_wait``
        (a hung endpoint does not hold the end), and one that fails is reported
        (the job's policy on failed saves does not fail a job that finished).
        """
        from checkpoint.api import CheckpointError, CheckpointTimeoutError

        if self._ckpt is None:
            return
        job = self._pending  # still pending while it is waited for: progress tells it
        wait = self._spec.checkpoint.final_wait
        if job is not None:
            try:
                self._record(job.wait(wait).step, "periodic", job.url)
            except CheckpointTimeoutError:
                self.faults.abandoned(job.step, self._pending_age())
                wait = timedelta(0)  # nothing more to wait for: the upload is left behind
            except CheckpointError as e:
                with contextlib.suppress(StorageFaultError):
                    self._save_failed(job.step, e)
        with contextlib.suppress(CheckpointError):  # told above: the saver only lets go now
            self._ckpt.close(wait)
        self._ckpt = None
        if job is not None and job.done():  # one left uploading is still told in progress
            self._pending = None


def _saved_hook_state(saved: dict[str, Any] | None, world_size: int) -> dict[str, Any] | None:
    """The comm hook state to load, or None to start the hook fresh (and say why)."""
    if saved is None:
        return None
    if int(saved["world_size"]) != world_size:
        # Residuals belong to a rank's share of the data; at another world size
        # they would not, and ranks would disagree on warm-up counters.
        log.warning(
            "checkpoint was saved by %d ranks, now %d: the comm hook starts fresh",
            int(saved["world_size"]),
            world_size,
        )
        return None
    log.warning("comm hook state restored from the checkpoint")
    return dict(saved["state"])


def _under(url: str | None, root: str) -> bool:
    """Whether checkpoint ``url`` is directly under ``root``."""
    return url is not None and url.rstrip("/").rsplit("/", 1)[0] == root.rstrip("/")
