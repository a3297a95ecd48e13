"""The :class:`Session` a training script holds (build it with :func:`agents.runtime.init`).

Runs in the training process.  The package's docstring (:mod:`agents.runtime`)
shows a script's use of it and how recovery works.  The session owns one
:class:`~agents.runtime.worker_state.WorkerState` and the runtime's parts;
the parts read the state and return what changed (a generation joined, a
boundary's decision), and the session applies it.

Over the 450 lines a module is held to: every name a script reads is a documented
property here, and the loop that leaves and joins generations reads best whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agents.api import (
    PREIMPORTS,
    JobEndedError,
    RecoveryError,
    Stateful,
    StorageFaultError,
    WorkerEnv,
)
from agents.channels.plan_feed import ENV_PLAN_FEED
from agents.messages import one_line
from agents.runtime.boundary import Agreement, StepBoundary, agree
from agents.runtime.breaks import Breaks
from agents.runtime.collective_guard import CollectiveGuard, OpTimeout
from agents.runtime.elastic_ddp import HookInstaller
from agents.runtime.failures import (
    PEER_SETTLE_S,
    CollectiveFailures,
    peer_failure,
    raised_in_collective,
)
from agents.runtime.generation import DataPlane, Generations, Joined
from agents.runtime.heartbeat import Heartbeat
from agents.runtime.participants import Lent
from agents.runtime.plan_watch import PlanWatcher
from agents.runtime.process_group import Groups, choose_device, hang_up, quiesce, teardown_group
from agents.runtime.saving import Saving
from agents.runtime.telemetry import WorkerTelemetry
from agents.runtime.worker_state import WorkerState
from agents.runtime.wrapping import WrappedModels, install_spec_hook
from agents.state.api import Recovery
from agents.sync.round_etcd import PieceServer, RoundsInEtcd
from agents.sync.rounds import maximum
from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.settings import SETTINGS
from orchestrator.spec.job import JobSpec, StragglerAction
from orchestrator.state import keys
from orchestrator.state.fencing import GenerationFence
from orchestrator.state.records import ProgressRecord

__all__ = ["SaveFn", "Session"]

log = logging.getLogger("ringmaster.worker")

#: ``fn(session, reason)``: a script's callback before each durable save.
SaveFn = Callable[["Session", str], None]


class Session:
    """One worker's view of the job, across generations; build it with :func:`~agents.runtime.init`.

    Args:
        env: what the node agent told the worker (job, node, local rank, etcd).
        client: the worker's etcd client (closed by :meth:`close`).
        spec: the job's spec.
        recoveries: the recovery of each kind of state a worker may hold, by kind
            (:data:`agents.recovery.kinds.RECOVERIES`, handed over by :func:`~agents.runtime.init`).
    """

    def __init__(
        self,
        env: WorkerEnv,
        client: EtcdClient,
        spec: JobSpec,
        recoveries: Mapping[str, Recovery],
    ) -> None:
        self._env = env
        self._client = client
        #: this worker's store of its outer syncs' pseudo-gradients, listening before any
        #: group forms: its connections are never taken for a generation's own (hang_up)
        self._pieces = PieceServer(env.address)
        if spec.sync.delayed:
            self._pieces.start()
        self._spec = spec
        self._state = WorkerState()
        self._finished = False
        self._backend, self._device = choose_device(spec.comm.backend.value, env.local_rank)
        timed = spec.fault_tolerance.stragglers.action is not StragglerAction.OFF
        self._telemetry = WorkerTelemetry(timed, self._device)
        self._failures = CollectiveFailures(self._telemetry.timing)
        self._models = WrappedModels(spec, self._device, self._failures, self._install_spec_hook)
        self._groups: Groups | None = None
        self._fence = GenerationFence(client, env.job)
        self._metrics: dict[str, float] = {}
        self._step_error: BaseException | None = None
        self._stop_requested = False
        self._votes = StepBoundary()
        self._saving = Saving(env, client, spec, self._fence, self._telemetry, self._state)
        self._watch = PlanWatcher(client, env.job, os.environ.get(ENV_PLAN_FEED))
        self._guard = CollectiveGuard(OpTimeout.of_job(spec), self._watch.latest_generation)
        self._heartbeat = Heartbeat(
            client,
            keys.job_progress(env.job) + self.worker,
            lambda: self._state.step,
            self._progress,
            spec.fault_tolerance.heartbeat_interval,
        )
        self._breaks = Breaks(env, client, self._heartbeat)
        self._generations = Generations(
            env,
            client,
            self._fence,
            self._watch,
            self._breaks,
            self._telemetry,
            recoveries,
            DataPlane(self._backend, self._device, spec.fault_tolerance.hang_timeout),
        )
        # What the first DDP of a generation imports lazily (torch._dynamo: about a second
        # alone, several on a loaded machine) is imported before the first beat: a node
        # counts as a warm spare only once joining costs it no import.
        for name in PREIMPORTS:
            importlib.import_module(name)
        self._heartbeat.start()
        self._heartbeat.beat_now()  # a waiting worker is a warm one: the controller counts it

    # -- what a script reads -----------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's global rank in the current generation (-1 before the first)."""
        return self._state.rank

    @property
    def world_size(self) -> int:
        """Ranks in the current generation (0 before the first)."""
        return self._state.world_size

    @property
    def local_rank(self) -> int:
        """This worker's rank on its node (``LOCAL_RANK``); it never changes."""
        return self._env.local_rank

    @property
    def device(self) -> torch.device:
        """Where this worker trains: its local rank's CUDA device under NCCL, else the CPU."""
        return self._device

    @property
    def step(self) -> int:
        """Steps completed: the step trained next (restored after a recovery or resume)."""
        return self._state.step

    @property
    def generation(self) -> int:
        """The generation (the controller's plan of who trains) this worker is in."""
        return self._state.generation

    @property
    def finished(self) -> bool:
        """:meth:`steps` reached its end (False when the job ended or stopped first)."""
        return self._finished

    @property
    def worker(self) -> str:
        """This worker's name: ``<node>-<local rank>`` (it keys its logs and progress)."""
        return keys.worker_id(self._env.node, self._env.local_rank)

    @property
    def spec(self) -> JobSpec:
        """The job's spec, as submitted (``max_steps``, ``checkpoint``, ...)."""
        return self._spec

    @property
    def recoveries(self) -> int:
        """Generations this worker left because of a failure."""
        return self._state.recoveries

    @property
    def last_recovery_s(self) -> float | None:
        """Seconds the last recovery took, from leaving a generation to joining the next."""
        return self._state.last_recovery_s

    @property
    def restored_from(self) -> str | None:
        """The durable checkpoint this worker's state was last resumed from, if any."""
        return self._state.restored_from

    @property
    def outer_steps(self) -> tuple[int, ...]:
        """Outer steps applied on this rank so far, per fragment, under a delayed sync
        (``sync.mode`` diloco or streaming_diloco); empty otherwise."""
        outer = self._models.outer
        return tuple(int(c) for c in outer.counts) if outer is not None else ()

    @property
    def outer_left_out(self) -> int:
        """Outer steps this rank's site took without its own pseudo-gradient in them: it
        reached the round after the others went ahead (``sync.quorum``)."""
        outer = self._models.outer
        return outer.totals.left_out if outer is not None else 0

    @property
    def step_failed(self) -> bool:
        """True after a :meth:`guard` body whose step failed (it will run again)."""
        return self._step_error is not None

    # -- what the script registers -----------------------------------------------------

    def wrap(
        self,
        module: nn.Module,
        hook_installer: HookInstaller | None = None,
        *,
        sharding: str | None = None,
        shard_size: int | None = None,
        redundancy_every_steps: int | None = None,
        mesh: Mapping[str, int] | None = None,
        tensor_plan: Mapping[str, Any] | None = None,
        pipeline: Any = None,
    ) -> Any:
        """Wrap ``module`` for data-parallel training across generations.

        Args:
            module: the model, built the same way (same seed) on every rank.
            hook_installer: a DDP comm hook of the script's own (``ddp`` only; not
                with the job file's ``comm.compression`` or ``comm.hierarchical``).
            sharding: ``ddp`` (every rank holds the whole model; the default without
                ``mesh``), ``fsdp`` (FSDP2
                over every rank: a lost slice comes from a buddy's copy, else from
                the durable checkpoint) or ``hsdp`` (shard within groups of
                ``shard_size`` ranks, replicate across them: a lost slice comes
                from its twin); see docs/sharded-models.md.
            shard_size: ``hsdp`` only: ranks per shard group (default: a node's).
            redundancy_every_steps: ``fsdp`` only: every this many steps each
                rank's slice is copied to a buddy on the next node (0: off).
                Default: the job file's ``fault_tolerance.redundancy.every_steps``.
            mesh: instead of ``sharding``: ``{"replicate": R, "shard": S, "tensor": T}``
                (each 1 by default; ``replicate`` -1 or left out: the rest of the
                world): tensor parallel over ``T`` neighbouring ranks, FSDP2 over
                ``S``, replicas over the rest; a lost rank's slices come from its
                twin in another replica.
            tensor_plan: with ``mesh`` ``tensor`` > 1: module name → ``ParallelStyle``
                for DTensor's ``parallelize_module``; default: each pair of
                ``nn.Linear`` in an ``nn.Sequential``, column- then row-wise.
            pipeline: with ``mesh`` ``pipeline`` > 1: a
                :class:`~agents.state.pipeline.Pipeline` (loss, micro-batches,
                schedule, split points); the model, an ``nn.Sequential``, is cut
                into stages and trained with ``model.step(inputs, target)``.

        Returns:
            An :class:`~agents.runtime.elastic_ddp.ElasticDDP` for ``ddp``, a
            :class:`~agents.state.sharding.ShardedModel` otherwise; build
            optimizers on its ``parameters()`` after this call.

        Raises:
            ValueError: an unknown mode, options of another mode, a comm hook of
                the script's and the job file's at once, a second
                sharded model in one session (a second model of any kind under a
                delayed sync), or an object tracked as ``outer`` under a delayed sync.

        On a GPU worker the module moves to :attr:`device` and DDP gets
        ``device_ids``, as in a torchrun script.
        """
        models = self._models
        if models.outer is None:  # a second model is refused by wrap itself
            models.check_tracked(self._state.tracked)
        wrapped = models.wrap(
            module,
            hook_installer,
            sharding,
            shard_size,
            redundancy_every_steps,
            mesh,
            tensor_plan,
            pipeline,
        )
        for part in models.participants:  # their own state is tracked like the model's
            self._state.tracked.update(part.tracked())
        return wrapped

    def _install_spec_hook(self, ddp: Any) -> None:
        resumed = self._saving.take_hook_state()
        self._state.hook = install_spec_hook(self._spec.comm, ddp, self._state.plan, resumed)

    def track(self, **objects: Stateful) -> None:
        """Register state a replacement must receive (model, optimizer, scheduler, data).

        The same objects go into durable checkpoints (see docs/training-loops.md).

        Raises:
            TypeError: an object has no ``state_dict()``/``load_state_dict()``.
            ValueError: ``outer`` under a delayed sync (the outer state's name).
        """
        self._models.check_tracked(objects)
        for name, obj in objects.items():
            if not isinstance(obj, Stateful):
                raise TypeError(f"{name} has no state_dict()/load_state_dict()")
            self._state.tracked[name] = obj

    def on_save(self, fn: SaveFn) -> None:
        """Call ``fn(session, reason)`` on every rank when a durable save is due.

        ``reason`` is ``requested`` (``ringmaster checkpoint``), ``periodic``
        (``checkpoint.every_steps``/``every_seconds``) or ``stop``.
        """
        self._saving.call_before_save(lambda reason: fn(self, reason))

    def report(self, **metrics: float) -> None:
        """Record metrics of the last step (published with progress).

        ``loss`` is plotted by ``ringmaster report``; ``samples`` (this rank's
        samples in the step) gives the job's samples/s.
        """
        self._metrics.update({k: float(v) for k, v in metrics.items()})

    # -- the loop ----------------------------------------------------------------------

    def steps(self, total: int | None = None) -> Iterator[int]:
        """Yield step numbers from the restored step to ``total``, recovering as needed.

        Args:
            total: the step to end before (default: the job file's ``max_steps``,
                else no end).

        Raises:
            Exception: the script's own error, raised in a step (inside
                :meth:`guard`) or at a step boundary (an ``on_save`` callback),
                after it was reported to the controller.
            RecoveryError: the job could not be recovered in-process.
        """
        limit = total if total is not None else (self._spec.max_steps or math.inf)
        if limit != math.inf:
            for part in self._models.participants:
                part.ends_at(int(limit))
        try:
            self._apply(self._join_next(1))
            yield from self._loop(limit)
        except JobEndedError as e:
            log.warning("%s; leaving", e)
            self.close()
            return
        self._finished = True
        self._finish()

    def _loop(self, limit: float) -> Iterator[int]:
        st, parts = self._state, self._models.participants
        while st.step < limit and not self._stop_requested:
            self._step_error = None
            self._failures.clear()
            current = st.step
            started = time.monotonic()
            yield current
            if self._step_error is not None:
                self._failed(self._step_error, f"step {current}")
                continue
            try:
                if st.hook is not None:
                    with self._failures.collective():
                        for w in self._models.ddps:
                            st.hook.after_optimizer_step(w.module)  # local SGD averages here
                st.step, st.has_state = current + 1, True
                slow = [part.grace_s(st.step) for part in parts if part.waits_at(st.step)]
                waits = self._guard.between_sites(max(slow)) if slow else contextlib.nullcontext()
                with waits:
                    for part in parts:
                        part.after_step(st.step, st.tracked)
                for part in parts:  # the slow group's timeout is learnt from its waits
                    for seconds in part.took():
                        self._guard.outer_synced(seconds)
                self._telemetry.step_done(st.hook, self._models.ddps)
                self._breaks.step_completed()
                if not any(part.behind(st.step) for part in parts):  # no vote while behind
                    self._boundary(time.monotonic() - started)
                self._guard.step_ended(time.monotonic() - started)
            except (RecoveryError, JobEndedError):
                raise
            except Exception as e:
                self._failed(e, f"step boundary {st.step}")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run one step's body; an error inside it is recorded and judged at the step
        boundary: a peer's failure triggers recovery, the script's own error ends
        the worker (raised by :meth:`steps`)."""
        try:
            yield
        except Exception as e:
            if not dist.is_initialized():
                raise
            self._step_error = e

    def _failed(self, error: BaseException, where: str) -> None:
        """Record, then vote: recover when a peer is gone, else raise the script's error."""
        plan = self._watch.wait_newer(self._state.generation, timeout=PEER_SETTLE_S)
        recorded = self._failures.take()
        if recorded is None and self._models.sharded is not None and raised_in_collective(error):
            recorded = error  # FSDP's collectives run in its hooks, where none is wrapped
        fault = error.fault if isinstance(error, StorageFaultError) else ""
        newer = plan.generation if plan is not None else None
        why = None if fault else peer_failure(error, recorded, newer)
        if why is not None:
            ended_by = self._guard.ended_by(error)
            self._telemetry.left_by = ended_by
            self._recover(f"{where} failed: {one_line(error)} ({why}; ended by {ended_by})")
            return
        reason = f"{where} raised {type(error).__name__}: {one_line(error)}"
        log.warning("%s; %s: leaving", reason, f"a {fault} fault" if fault else "the script's own")
        st = self._state
        reason = str(error) if fault else reason
        self._breaks.report(st.generation, st.step, reason, False, True, fault)
        self._stop_parts()
        raise error

    # -- generations -------------------------------------------------------------------

    def _recover(self, reason: str, planned: bool = False) -> None:
        """Leave the current generation and join the next one.

        Raises:
            RecoveryError: the same step failed too often, or no generation came.
            JobEndedError: the job ended while this worker waited.
        """
        st = self._state
        started = time.monotonic()
        self._breaks.count_break(st.step, reason, planned)
        st.recoveries += 0 if planned else 1
        log.warning("generation %d ends: %s", st.generation, reason)
        st.hook = None
        self._guard.detach()
        self._models.drop()
        if not planned and self._groups is not None:
            # a local survivor may wait on this rank in a collective: end its wait now
            # (hang_up), not at its operation timeout
            hang_up(self._groups.sockets)
        self._stop_participants()  # before the group goes: they may wait on the dead peer
        teardown_group()
        self._groups = None
        self._breaks.report(st.generation, st.step, reason, planned)
        self._apply(self._join_next(st.generation + 1))
        st.last_recovery_s = time.monotonic() - started
        log.warning(
            "rejoined as rank %d/%d in generation %d at step %d (%.3fs)",
            st.rank,
            st.world_size,
            st.generation,
            st.step,
            st.last_recovery_s,
        )

    def _join_next(self, min_generation: int) -> Joined:
        """Join the first generation from ``min_generation`` on (see :class:`Generations`)."""
        return self._generations.join_next(min_generation, self._state, self._models, self._saving)

    def _apply(self, joined: Joined) -> None:
        """Take ``joined`` as this worker's generation: its place, its state, its DDP."""
        st = self._state
        st.plan, st.generation = joined.plan, joined.generation
        st.rank, st.world_size = joined.rank, joined.world_size
        st.step, st.has_state = joined.step, joined.has_state
        if joined.restored_from is not None:
            st.restored_from = joined.restored_from
        self._telemetry.state_restored(st.step)
        self._votes.joined()
        self._models.rebuild()
        parts = self._models.participants
        self._votes.sites = any(part.across_sites for part in parts)
        timeout = self._guard.timeout
        lent = Lent(
            self._site_vote,
            self._moved_on,
            timeout.between_sites,
            lambda: timeout.ceiling,
            RoundsInEtcd(self._client, self._env.job, st.generation, self._pieces),
        )
        for part in parts:
            part.lend(lent)
            part.joined(st.step if st.has_state else None)
        self._groups = dataclasses.replace(
            self._generations.settled(joined),
            stepwise=tuple(g for part in parts for g in part.step_groups()),
        )
        self._heartbeat.start()
        self._heartbeat.poke()
        self._guard.attach(self._groups, st.generation)

    # -- step boundary -----------------------------------------------------------------

    def _boundary(self, step_seconds: float) -> None:
        """The step boundary: vote when one is due (:mod:`agents.runtime.boundary`), then act."""
        st = self._state
        agreed = self._vote(step_seconds) if self._votes.votes_at(st.step) else None
        generation = st.generation
        if agreed is None:  # between votes: a participant may have heard of a newer one
            for part in self._models.participants:
                seen = part.newest_generation(self._watch.latest_generation())
                generation = max(generation, seen) if seen is not None else generation
        rounds = [v for part in self._models.participants if (v := part.agreed(st.step))]
        across = Agreement.of_vector(maximum(rounds)) if rounds else None
        decision = self._votes.decide(st.step, generation, agreed, self._saving.trigger, across)
        if decision.pause:
            st.paused = f"etcd unreachable at step {st.step}"
            try:
                self._generations.wait_for_etcd(st.step)
            finally:
                st.paused = None
        self._heartbeat.poke()
        if decision.settle:
            self._saving.poll()
        if decision.saves:  # a save's collectives may wait on rank 0's storage: no learnt timeout
            with self._guard.relaxed():
                for reason in decision.saves:
                    self._saving.save(reason)
        self._votes.served(decision)
        if decision.stop:
            self._stop_requested = True
            return
        if decision.generation > st.generation:
            self._telemetry.left_by = None  # this step ended well: nothing had to end it
            self._recover(f"generation {decision.generation} published", planned=True)

    def _moved_on(self) -> bool:
        return self._watch.latest_generation() > self._state.generation

    def _site_vote(self, group: dist.ProcessGroup) -> tuple[int, ...]:
        """A vote inside ``group`` (a site's, at an outer sync's start), as integers."""
        return self._vote(0.0, group).vector()

    def _vote(self, step_seconds: float, group: dist.ProcessGroup | None = None) -> Agreement:
        contact = SETTINGS.etcd_contact_timeout.total_seconds()
        mine = self._votes.propose(
            generation=self._watch.latest_generation(),
            control=self._watch.control(),
            etcd_lost=self._client.unreachable_for() > contact,
            time_due=self._saving.trigger.time_due(),
            step_seconds=step_seconds,
            save_unsettled=self._saving.unsettled(),
        )
        if group is None:  # a delayed sync's site votes inside itself
            groups = (p.vote_group() for p in self._models.participants)
            group = next((g for g in groups if g is not None), None)
        if group is None:
            group = self._groups.control if self._groups is not None else None
        with self._failures.collective():
            return agree(mine, group=group, timing=self._failures.timing)

    # -- the end -----------------------------------------------------------------------

    def _finish(self) -> None:
        st = self._state
        self._saving.close()
        with contextlib.suppress(EtcdError):
            self._heartbeat.beat_now()
        self._generations.record_done(st.step, st.generation)
        self._heartbeat.stop()
        try:
            last = quiesce()  # held until the group is gone (see quiesce)
        except RuntimeError as e:  # a peer left at the very end: nothing to wait for
            log.debug("no barrier before leaving: %s", e)
            last = None
        self._guard.close()
        self._models.drop(gradients=False)  # a script may still read its model
        self._stop_participants()
        teardown_group()
        del last

    def _progress(self, beat: float, step_time: float) -> ProgressRecord:
        """This worker's progress as of ``beat``, for its heartbeat (the heartbeat's thread)."""
        return self._state.progress(
            beat,
            step_time,
            metrics=self._metrics,
            telemetry=self._telemetry.record(*(p.telemetry() for p in self._models.participants)),
            joining=self._generations.joining,
            uploading=self._saving.uploading(),
        )

    def _stop_parts(self) -> None:
        """Stop the threads and the group (the etcd client stays open)."""
        self._heartbeat.stop()
        self._watch.stop()
        self._guard.close()
        self._stop_participants()
        teardown_group()

    def _stop_participants(self) -> None:
        for part in self._models.participants:
            part.stop()

    def close(self) -> None:
        """Leave: stop the heartbeat, the watches and the group, close the etcd client.

        :meth:`steps` calls it when the job ended first; a script calls it after
        its loop (a finished loop has already recorded the end of training).
        """
        self._stop_parts()
        self._client.close()
