"""Durable checkpoints from the worker runtime: the glue to :mod:`checkpoint`.

Each generation gets a :class:`~checkpoint.Checkpointer` on its own process
group (creating it is collective).  A fresh job restores from the newest
committed checkpoint (or from the one a resubmitted job was given); saves
happen at step boundaries that every rank agreed on (:mod:`agents.runtime.boundary`):
on request, on stop, and periodically, every ``checkpoint.every_steps``
steps or ``checkpoint.every_seconds`` seconds.  Rank 0 records each commit in
etcd as a :class:`~orchestrator.records.CheckpointRecord`, through the
generation fence, so a fenced-out process never claims a checkpoint; the
commit itself is fenced too (:meth:`Saving.check_commit`).  A save may take
``RINGMASTER_CHECKPOINT_SAVE_TIMEOUT`` (``SETTINGS.checkpoint_save_timeout``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from torch import nn

from agents.messages import one_line
from agents.runtime.elastic_ddp import ElasticDDP
from agents.runtime.sharding import ShardedModel
from orchestrator import keys
from orchestrator.api import EtcdError
from orchestrator.etcd.fencing import FencedError
from orchestrator.records import CheckpointRecord
from orchestrator.settings import SETTINGS

if TYPE_CHECKING:
    from agents.runtime.session import Session

log = logging.getLogger("ringmaster.worker")

#: Key of the comm hook's state in a checkpoint's per-rank state.
HOOK_STATE = "comm_hook"

#: Tracked names that fill a ``TrainState`` field of their own (the rest go to ``objects``).
_OWN_FIELDS = ("model", "optimizer", "scheduler")


class Saving:
    """One worker's checkpointer, its pending save and its periodic schedule."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self._ckpt: Any = None
        self._pending: Any = None
        self._commit_refused: str | None = None
        #: comm hook state restored from a checkpoint, for the next hook built
        self.hook_resume: dict[str, Any] | None = None
        self._last_save = time.monotonic()

    def save_due_by_time(self) -> bool:
        """``checkpoint.every_seconds`` passed since this worker's last save (or its first
        generation's start)."""
        every = self._s.spec.checkpoint.every_seconds
        return every > 0 and time.monotonic() - self._last_save >= every

    # -- per generation ----------------------------------------------------------------

    def open(self, first: bool) -> None:
        """A checkpointer on this generation's group (creating it is collective)."""
        from checkpoint import Checkpointer
        from orchestrator.jobs import checkpoint_hash

        s = self._s
        previous = self._ckpt
        self._ckpt = None
        self._pending = None
        cfg = s.spec.checkpoint
        url = cfg.url if "://" in cfg.url else f"file://{os.path.abspath(cfg.url)}"
        self._ckpt = Checkpointer(
            url,
            keep=cfg.keep,
            job_spec_hash=checkpoint_hash(s.spec),
            check_storage=first,
            fence=self.check_commit,
        )
        if previous is None:
            self._last_save = time.monotonic()  # the periodic clock starts with training
        else:
            # Same model, and usually the same share: the first save of this
            # generation then copies into existing buffers instead of allocating.
            self._ckpt.adopt_staging(previous)

    def check_commit(self) -> None:
        """Commit fence for durable checkpoints: only a current member commits."""
        from checkpoint.api import CommitFencedError

        try:
            self._s.fence.check()
        except FencedError as e:
            self._commit_refused = str(e)
            raise CommitFencedError(f"checkpoint not committed: {e}") from e

    def train_state(self) -> Any:
        """Everything tracked as a ``TrainState`` (None without a tracked ``model``).

        ``model``, ``optimizer`` and ``scheduler`` fill their own fields; every
        other tracked object (a ``GradScaler``, more LR schedulers, EMA weights,
        counters, DCP ``Stateful`` objects) goes into ``objects`` under its name,
        so a resume from a durable checkpoint brings back all that a
        replacement receives from a live peer.
        """
        from checkpoint import TrainState

        s = self._s
        model = s.tracked.get("model")
        if isinstance(model, ElasticDDP | ShardedModel):
            # the plain (or the fully_shard-ed) module: checkpoints load without ringmaster
            model = model.module
        if not isinstance(model, nn.Module):
            return None
        rank_state = {}
        if s.hook is not None:  # per rank: residuals, PowerSGD factors, its RNG
            rank_state[HOOK_STATE] = {"world_size": s.world_size, "state": s.hook.state_dict()}
        return TrainState(
            model=model,
            optimizer=s.tracked.get("optimizer"),  # type: ignore[arg-type]
            scheduler=s.tracked.get("scheduler"),
            samples_seen=s.step,
            rank_state=rank_state,
            objects={k: v for k, v in s.tracked.items() if k not in _OWN_FIELDS},
        )

    def resume(self) -> bool:
        """Restore the newest durable state, if there is one (every rank, collectively).

        Returns:
            True when a checkpoint was loaded.
        """
        from orchestrator.jobs import read_resume

        s = self._s
        # A resubmitted job (`ringmaster resume`, `run --from`) starts from the checkpoint
        # it was given, until it has committed one of its own; every rank reads the same
        # records, as no save can happen before all ranks have restored.
        request = read_resume(s.client, s.env.job)
        if request is not None and s.client.get(keys.job_checkpoint(s.env.job)) is None:
            url: str | None = request.url
        else:
            url = None
        state = self.train_state()
        result = self._ckpt.restore(state, url=url)
        self.hook_resume = self._saved_hook_state(state.rank_state.get(HOOK_STATE))
        if result.step is not None:
            s.step = int(result.step)
            s.has_state = True
            s.restored_from = result.url
            log.warning("resumed from %s at step %d", result.url, s.step)
            return True
        return False

    def _saved_hook_state(self, saved: dict[str, Any] | None) -> dict[str, Any] | None:
        """The comm hook state to load, or None to start the hook fresh (and say why)."""
        s = self._s
        if saved is None:
            return None
        if int(saved["world_size"]) != s.world_size:
            # Residuals belong to a rank's share of the data; at another world size
            # they would not, and ranks would disagree on warm-up counters.
            log.warning(
                "checkpoint was saved by %d ranks, now %d: the comm hook starts fresh",
                int(saved["world_size"]),
                s.world_size,
            )
            return None
        log.warning("comm hook state restored from the checkpoint")
        return dict(saved["state"])

    # -- saving ------------------------------------------------------------------------

    def save(self, reason: str) -> None:
        """Save now (every rank at the same boundary): periodic saves may run async."""
        s = self._s
        self._last_save = time.monotonic()
        if s.save_fn is not None:
            s.save_fn(s, reason)
        state = self.train_state()
        if self._ckpt is None or state is None:
            return
        started = time.perf_counter()
        if reason == "periodic" and s.spec.checkpoint.async_:
            job = self._ckpt.save_async(s.step, state)
            s.telemetry.checkpoint_blocked(time.perf_counter() - started)
            if job is not None:
                self._pending = job
            return
        try:
            manifest = self._ckpt.save_now(s.step, state, timeout=SETTINGS.checkpoint_save_timeout)
        except Exception as e:
            if not self._refused_commit(e):
                raise
            return
        s.telemetry.checkpoint_blocked(time.perf_counter() - started)
        s.telemetry.checkpoint_uploaded(time.perf_counter() - started)
        self._record(manifest.step, reason)

    def poll(self) -> None:
        """Record the pending async save once it committed."""
        job = self._pending
        if job is not None and job.done():
            self._pending = None
            try:
                manifest = job.wait(SETTINGS.checkpoint_save_timeout)
            except Exception as e:
                if not self._refused_commit(e):
                    raise
                return
            self._s.telemetry.checkpoint_uploaded(getattr(job, "upload_seconds", None))
            self._record(manifest.step, "periodic")

    def _refused_commit(self, e: BaseException) -> bool:
        """True (and logged) when a save failed because the commit fence refused it."""
        refused, self._commit_refused = self._commit_refused, None
        if refused is None:
            return False
        log.warning("%s (%s)", refused, one_line(e))
        return True

    def _record(self, step: int, reason: str) -> None:
        s = self._s
        if s.rank != 0:
            return
        url = s.spec.checkpoint.url
        record = CheckpointRecord(url=url, step=step, reason=reason, at=time.time())
        try:
            s.fence.put(keys.job_checkpoint(s.env.job), record.encode())
        except (FencedError, EtcdError) as e:
            log.warning("checkpoint of step %d not recorded: %s", step, e)

    def close(self) -> None:
        """Wait for the pending save (and record it), then close the checkpointer."""
        if self._ckpt is None:
            return
        job, self._pending = self._pending, None
        timeout = SETTINGS.checkpoint_save_timeout
        if job is not None:
            self._record(job.wait(timeout).step, "periodic")
        self._ckpt.close(timeout)
        self._ckpt = None
