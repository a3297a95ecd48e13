"""Joining a generation, and leaving a broken one for the next (in the training process).

A generation is the controller's plan of who trains (:class:`Plan`).  To join
one, a worker waits until a plan of at least the generation it needs
includes its node, forms that generation's process group
(:mod:`agents.runtime.process_group`), opens its checkpointer and brings every rank
to the freshest live state (:mod:`agents.recovery.state_sync`), or to the newest
durable checkpoint when no rank holds live state (a fresh or resumed job).
A sharded model gets its slices instead (:mod:`agents.recovery.shard_recovery`).
:meth:`Generations.join_next` returns what was joined (:class:`Joined`: the
plan, this worker's rank, the groups, the step and where the state came
from); the session applies it and rebuilds its DDP on the new group.

When a generation breaks (a peer is gone, or the controller switched to a
new plan), the session drops its DDP and group, :class:`Generations` reports
the break (a :class:`BreakReport`, keyed by generation, so a late report can
never affect a newer one: through its node agent, which writes one record
for its workers, or under the generation's ``reports/`` prefix itself) and
joins the next.  A group that does not form is reported like a broken
generation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agents.api import (
    DurableState,
    JobEndedError,
    RecoveryError,
    StateMismatchError,
    UnequalSitesError,
    WorkerEnv,
    WorkerView,
)
from agents.recovery import shard_recovery
from agents.recovery.site_shards import Placed, join_site_shards
from agents.recovery.state_sync import NO_STATE, sync_state
from agents.runtime import live_state
from agents.runtime.process_group import (
    Groups,
    form_group,
    publish_environment,
    socket_inodes,
    sockets_opened_since,
    teardown_group,
)
from agents.runtime.storage_faults import StorageFaultError
from agents.sync.site_join import join_sites
from orchestrator.api import EtcdError, EtcdUnavailableError
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.settings import SETTINGS
from orchestrator.state import keys, records
from orchestrator.state.api import FencedError, RecordError
from orchestrator.state.records import BreakReport, DoneRecord, JobStatus, Plan

if TYPE_CHECKING:
    from agents.recovery.shard_recovery import RecoveryTelemetry
    from agents.runtime.heartbeat import Heartbeat
    from agents.runtime.plan_watch import PlanWatcher
    from agents.runtime.wrapping import WrappedModels
    from orchestrator.etcd.client import EtcdClient
    from orchestrator.spec.job import JobSpec
    from orchestrator.state.fencing import GenerationFence

__all__ = ["MAX_FAILURES_PER_STEP", "Generations", "Joined"]

log = logging.getLogger("ringmaster.worker")

#: A step that fails this many times in a row is not a peer failure: give up.
MAX_FAILURES_PER_STEP = 5


@dataclass(frozen=True)
class Joined:
    """A generation this worker joined, and the state it holds there (the session applies it)."""

    plan: Plan
    #: this worker's global rank in it
    rank: int
    groups: Groups
    #: the step every rank trains next
    step: int
    #: the tracked objects hold the state of ``step``
    has_state: bool
    #: the durable checkpoint the state was resumed from (None: from memory, or fresh)
    restored_from: str | None
    #: sockets open before the group formed (see :meth:`Generations.settled`)
    sockets_before: frozenset[int]

    @property
    def generation(self) -> int:
        return self.plan.generation

    @property
    def world_size(self) -> int:
        return self.plan.world_size


class Generations:
    """Moves one worker from generation to generation (see the module docstring).

    Args:
        env: the worker's environment (job, node, local rank, address).
        client: the worker's etcd client.
        spec: the job's spec.
        fence: the worker's generation fence (joined here, left when fenced out).
        watch: the plan watcher.
        heartbeat: relays break reports through the node agent.
        telemetry: records when groups formed and where sharded state came from.
        durable: the durable checkpoints (opened per generation, resumed from).
        backend: the data plane's backend (``gloo``, ``nccl``).
        device: this worker's device.
    """

    def __init__(
        self,
        env: WorkerEnv,
        client: EtcdClient,
        spec: JobSpec,
        fence: GenerationFence,
        watch: PlanWatcher,
        heartbeat: Heartbeat,
        telemetry: RecoveryTelemetry,
        durable: DurableState,
        backend: str,
        device: torch.device,
    ) -> None:
        self._env = env
        self._client = client
        self._spec = spec
        self._fence = fence
        self._watch = watch
        self._heartbeat = heartbeat
        self._telemetry = telemetry
        self._durable = durable
        self._backend = backend
        self._device = device
        self._failures_at_step = 0
        #: ``(generation, rank, world size)`` of the generation being joined, from the
        #: start of a join until it :meth:`settled` (the worker's progress names it)
        self.joining: tuple[int, int, int] | None = None

    @property
    def _worker(self) -> str:
        return keys.worker_id(self._env.node, self._env.local_rank)

    # -- leaving -----------------------------------------------------------------------

    def count_break(self, step: int, reason: str, planned: bool) -> None:
        """Count a generation left at ``step`` (a planned change counts nothing).

        Raises:
            RecoveryError: the same step failed too often.
        """
        self._failures_at_step += 0 if planned else 1
        if self._failures_at_step > MAX_FAILURES_PER_STEP:
            raise RecoveryError(
                f"step {step} failed {self._failures_at_step} times in a row; last: {reason}"
            )

    def step_completed(self) -> None:
        """A step completed: the count of failures of one step starts again."""
        self._failures_at_step = 0

    def report(
        self, generation: int, step: int, reason: str, planned: bool, user_error: bool = False,
        fault: str = "", unequal_sites: bool = False,
    ) -> None:  # fmt: skip
        """Tell the controller that ``generation`` broke here at ``step`` (best effort)."""
        report = BreakReport(step, reason, planned, time.time(), user_error, fault, unequal_sites)
        if self._heartbeat.relay_report(generation, report):
            return  # the node agent wrote it, with its other workers' (agents.node.break_reports)
        try:
            records.write(
                self._client, keys.job_reports(self._env.job, generation) + self._worker, report
            )
        except EtcdError as e:
            log.warning("could not report the end of generation %d: %s", generation, e)

    # -- joining -----------------------------------------------------------------------

    def join_next(self, min_generation: int, held: WorkerView, models: WrappedModels) -> Joined:
        """Join the first generation from ``min_generation`` on whose group forms.

        A group that does not form is reported like a broken generation, and
        the worker waits for the next.  The session's DDP is not rebuilt
        here: the session does it, then calls :meth:`settled`.

        Args:
            min_generation: the first generation to join.
            held: the worker as it stands (its step, whether it holds state).
            models: what the script wrapped (a sharded model gets its slices here,
                and its buddy copies start on the new group).

        Raises:
            RecoveryError: no generation including this worker came in time.
            JobEndedError: the job ended while this worker waited.
            StorageFaultError: ``checkpoint.url`` cannot be written, or the checkpoint
                asked for cannot be used (reported: the controller fails the job).
            StateMismatchError: the state a peer sent does not fit this worker's
                (reported as the script's error).
        """
        holds_state = held.has_state
        while True:
            plan, holds_state = self._await_plan(min_generation, held.step, holds_state)
            try:
                return self._join(plan, held, holds_state, models)
            except (RecoveryError, UnequalSitesError) as e:
                log.warning("%s", e)
                uneven = isinstance(e, UnequalSitesError)  # the controller evens the sites
                if uneven:
                    teardown_group()  # nothing was exchanged: the state held is whole
                self.report(plan.generation, held.step, str(e), False, unequal_sites=uneven)
                min_generation = plan.generation + 1
            except StorageFaultError as e:  # the job's checkpoints, not a peer: the job fails
                log.error("%s", e)
                self.report(plan.generation, held.step, str(e), False, True, e.fault)
                raise
            except StateMismatchError as e:  # the script's models differ: no peer to wait for
                log.error("%s", e)
                self.report(plan.generation, held.step, str(e), False, True)
                raise

    def settled(self, joined: Joined) -> Groups:
        """``joined``'s groups with the sockets they opened (once the DDP is rebuilt on them).

        Those are the sockets a failed generation hangs up on
        (:func:`~agents.runtime.process_group.hang_up`); etcd's are kept.
        """
        self.joining = None
        opened = sockets_opened_since(joined.sockets_before, _etcd_ports(self._client))
        return dataclasses.replace(joined.groups, sockets=opened)

    def _await_plan(self, min_generation: int, step: int, holds_state: bool) -> tuple[Plan, bool]:
        """Block until a plan of at least ``min_generation`` that includes this worker.

        Returns:
            The plan, and whether this worker still holds state (it drops it when
            a newer generation left it out: it was replaced while away).
        """
        timeout = SETTINGS.plan_timeout.total_seconds()
        deadline = time.monotonic() + timeout
        joined_before = min_generation > 1
        while True:
            plan = self._watch.wait_newer(min_generation - 1, timeout=1.0)
            if plan is not None:
                member = plan.member(self._env.node)
                if member is not None and self._env.local_rank < member.nproc:
                    return plan, holds_state
                if holds_state and joined_before:
                    # Replaced while away (partitioned, or too slow): the state held
                    # here is stale.  Drop it and wait as a spare that gets live state.
                    log.warning(
                        "fenced out: generation %d does not include this node; "
                        "dropping the state of step %d and waiting as a spare",
                        plan.generation,
                        step,
                    )
                    holds_state = False
                    self._fence.leave()
                min_generation = plan.generation + 1  # not in it: wait as a spare
            status = self._job_status()
            if status is not None and status.phase.terminal:
                raise JobEndedError(f"job {self._env.job} is {status.phase.value}")
            if time.monotonic() > deadline:
                raise RecoveryError(
                    f"no generation >= {min_generation} including {self._worker} within "
                    f"{timeout:g}s (RINGMASTER_PLAN_TIMEOUT)"
                )

    def _job_status(self) -> JobStatus | None:
        try:
            return records.read(self._client, keys.job_status(self._env.job), JobStatus)
        except (EtcdError, RecordError) as e:
            log.debug("job phase unknown: %s", e)
            return None

    def _join(
        self,
        plan: Plan,
        held: WorkerView,
        holds_state: bool,
        models: WrappedModels,
    ) -> Joined:
        sharded, buddies = models.sharded, models.buddies
        member = plan.member(self._env.node)
        assert member is not None
        rank = member.rank_base + self._env.local_rank
        self.joining = (plan.generation, rank, plan.world_size)
        self._fence.join(plan.generation, self._watch.revision_of(plan.generation))
        sockets_before = frozenset(socket_inodes())
        hang = self._spec.fault_tolerance.hang_timeout
        ceiling = hang * 2  # the guard learns a shorter one
        groups = form_group(
            self._client,
            self._env.job,
            plan.generation,
            rank,
            plan.world_size,
            self._env.address,
            collective_timeout=ceiling,
            fence=self._fence,
            backend=self._backend,
            device=self._device,
        )
        self._telemetry.group_formed(plan.generation)
        publish_environment(plan, self._env.node, rank, *groups.store)
        step, has_state, restored_from = held.step, holds_state, None
        try:
            self._durable.open(first=plan.generation == 1)
            if sharded is not None and models.outer is not None:  # fsdp in each site
                at = Placed(plan, rank, member.nproc, self._device, hang, self._durable)
                got = join_site_shards(
                    models.outer, sharded, buddies, held, holds_state, at, groups.control, ceiling
                )
                initial = got.source == shard_recovery.SOURCE_INITIAL
                step, has_state = got.step, holds_state or not initial
                self._telemetry.state_source(got.source, got.lost)
            elif sharded is not None:
                placement = shard_recovery.Placement(
                    rank, plan.world_size, plan.members[0].nproc, self._device
                )
                got = shard_recovery.join(
                    held, holds_state, sharded, buddies, placement, self._durable, groups.control
                )
                step, restored_from = got.step, got.restored_from
                has_state = holds_state or got.source != shard_recovery.SOURCE_INITIAL
                self._telemetry.state_source(got.source, got.lost)
                if buddies is not None:
                    buddies.forget_after(got.step)
                    layouts = shard_recovery.layouts(sharded, placement)
                    buddies.start(rank, plan.world_size, member.nproc, layouts, sharded.rows, hang)
            else:
                mine = held.step if holds_state else NO_STATE
                capture = functools.partial(live_state.capture, held.step, held.tracked)
                restore = functools.partial(live_state.restore, held.tracked)
                one = models.ddps[0].module if models.replicas_identical() else None
                shared = live_state.replicated(held.tracked, one) if one is not None else None
                if models.outer is not None:  # a delayed sync: each site its own state
                    outer, control = models.outer, groups.control
                    synced = join_sites(
                        outer, plan, rank, mine, capture, restore, control, ceiling, shared
                    )
                else:
                    synced = sync_state(mine, capture, restore, groups.control, shared=shared).step
                if synced != NO_STATE:
                    step, has_state = synced, True
                elif self._durable.can_resume():
                    resumed = self._durable.resume(plan.world_size)
                    if resumed is not None:
                        step, has_state, restored_from = resumed.step, True, resumed.url
        except RuntimeError as e:  # the new group broke already: a member is gone again
            teardown_group()
            raise RecoveryError(
                f"generation {plan.generation}: state sync failed ({e}); a member may be gone"
            ) from e
        return Joined(plan, rank, groups, step, has_state, restored_from, sockets_before)

    def record_done(self, step: int, generation: int) -> None:
        """Record that this worker finished training (through the fence: a fenced-out
        process records nothing)."""
        done = DoneRecord(step=step, generation=generation, at=time.time())
        key = keys.job_done(self._env.job) + self._worker
        try:
            retry_unavailable(
                lambda: self._fence.put(key, done.encode()),
                "recording the end of training",
                max_wait=SETTINGS.plan_timeout,
            )
        except FencedError as e:
            log.warning("not recording the end of training: %s", e)

    # -- etcd outages ------------------------------------------------------------------

    def wait_for_etcd(self, step: int) -> None:
        """Wait, state kept, until etcd answers again (every rank pauses at this step).

        Training on without etcd would go unnoticed by the controller and could
        not be fenced, so an outage pauses the job instead of failing it.

        Raises:
            RecoveryError: etcd stayed away for ``RINGMASTER_PLAN_TIMEOUT``.
        """
        started = time.monotonic()
        log.warning("etcd unreachable at step %d: pausing until etcd is back", step)
        client, watch = self._client, self._watch

        def back() -> None:
            _check_writable(client)  # a read answers under NOSPACE; wait for writes
            watch.load()

        try:
            retry_unavailable(back, f"paused at step {step}", max_wait=SETTINGS.plan_timeout)
        except EtcdError as e:
            raise RecoveryError(
                f"etcd stayed unreachable for {SETTINGS.plan_timeout.total_seconds():g}s "
                f"(RINGMASTER_PLAN_TIMEOUT) while paused at step {step}: {e}"
            ) from e
        log.warning(
            "etcd is back; resuming at step %d after %.1fs", step, time.monotonic() - started
        )


def _check_writable(client: EtcdClient) -> None:
    """Raise while etcd's NOSPACE alarm is raised: reads answer then, writes do not.

    A worker whose etcd user may not list alarms (etcd with auth) goes by the read.

    Raises:
        EtcdUnavailableError: etcd refuses writes for want of space, or does not answer.
    """
    try:
        client.check_writable()
    except EtcdUnavailableError:
        raise
    except EtcdError:
        pass


def _etcd_ports(client: EtcdClient) -> set[int]:
    """The ports of etcd's client endpoints (``host:port`` or ``http(s)://host:port``)."""
    ports = set()
    for endpoint in client.endpoints:
        tail = endpoint.rstrip("/").rsplit(":", 1)[-1]
        if tail.isdigit():
            ports.add(int(tail))
    return ports
