"""Joining a generation, and leaving a broken one for the next (in the training process).

A generation is the controller's plan of who trains (:class:`Plan`).  To join
one, a worker waits until a plan of at least the generation it needs
includes its node, forms that generation's process group
(:mod:`agents.runtime.process_group`) and opens its checkpointer: what every
join does, whatever the worker holds.  The rest, bringing every rank to the
freshest live state or to the newest durable checkpoint, depends on the kind
of state the session holds (DDP replicas, a sharded model's slices, sites
under a delayed sync): :class:`Generations` hands it to that kind's
:class:`~agents.state.api.Recovery`, found in the table it was given (keyed
by :attr:`~agents.state.api.Holdings.kind`; the implementations are
:mod:`agents.recovery`'s, which the runtime never imports).
:meth:`Generations.join_next` returns what was joined (:class:`Joined`: the
plan, this worker's rank, the groups, the step and where the state came
from); the session applies it and rebuilds its DDP on the new group.

When a generation breaks (a peer is gone, or the controller switched to a
new plan), the session drops its DDP and group, reports the break
(:mod:`agents.runtime.breaks`) and :class:`Generations` joins the next.  A
group that does not form is reported like a broken generation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from agents.api import (
    DurableState,
    JobEndedError,
    RecoveryError,
    StateMismatchError,
    StorageFaultError,
    UnequalSitesError,
    WorkerEnv,
    WorkerView,
)
from agents.runtime.process_group import (
    Groups,
    form_group,
    publish_environment,
    socket_inodes,
    sockets_opened_since,
    teardown_group,
)
from agents.state.api import Holdings, Joining, Recovery
from orchestrator.api import EtcdError, EtcdUnavailableError
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.settings import SETTINGS
from orchestrator.state import keys, records
from orchestrator.state.api import FencedError, RecordError
from orchestrator.state.records import DoneRecord, JobStatus, Plan

if TYPE_CHECKING:
    from agents.runtime.breaks import Breaks
    from agents.runtime.plan_watch import PlanWatcher
    from agents.runtime.telemetry import WorkerTelemetry
    from orchestrator.etcd.client import EtcdClient
    from orchestrator.state.fencing import GenerationFence

__all__ = ["DataPlane", "Generations", "Joined"]

log = logging.getLogger("ringmaster.worker")


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


@dataclass(frozen=True)
class DataPlane:
    """How this worker's generations move data: what forming a group needs."""

    #: the data plane's backend (``gloo``, ``nccl``)
    backend: str
    #: this worker's device
    device: torch.device
    #: ``fault_tolerance.hang_timeout``: what an exchange of buddy copies may take
    hang_timeout: timedelta

    @property
    def collective_timeout(self) -> timedelta:
        """A new group's collective timeout: twice the hang timeout (the collective
        guard learns a shorter one from the steps)."""
        return self.hang_timeout * 2


class Generations:
    """Moves one worker from generation to generation (see the module docstring).

    Args:
        env: the worker's environment (job, node, local rank, address).
        client: the worker's etcd client.
        fence: the worker's generation fence (joined here, left when fenced out).
        watch: the plan watcher.
        breaks: reports a generation whose group did not form, or whose join failed.
        telemetry: records when groups formed and where the state came from.
        recoveries: the recovery of each kind of state (:attr:`Holdings.kind`).
        plane: the data plane's backend, device and hang timeout.
    """

    def __init__(
        self,
        env: WorkerEnv,
        client: EtcdClient,
        fence: GenerationFence,
        watch: PlanWatcher,
        breaks: Breaks,
        telemetry: WorkerTelemetry,
        recoveries: Mapping[str, Recovery],
        plane: DataPlane,
    ) -> None:
        self._env = env
        self._client = client
        self._fence = fence
        self._watch = watch
        self._breaks = breaks
        self._telemetry = telemetry
        self._recoveries = recoveries
        self._plane = plane
        #: ``(generation, rank, world size)`` of the generation being joined, from the
        #: start of a join until it :meth:`settled` (the worker's progress names it)
        self.joining: tuple[int, int, int] | None = None

    @property
    def _worker(self) -> str:
        return keys.worker_id(self._env.node, self._env.local_rank)

    # -- joining -----------------------------------------------------------------------

    def join_next(
        self, min_generation: int, held: WorkerView, holdings: Holdings, durable: DurableState
    ) -> Joined:
        """Join the first generation from ``min_generation`` on whose group forms.

        A group that does not form is reported like a broken generation, and
        the worker waits for the next.  The session's DDP is not rebuilt
        here: the session does it, then calls :meth:`settled`.

        Args:
            min_generation: the first generation to join.
            held: the worker as it stands (its step, whether it holds state).
            holdings: what the script wrapped: its kind picks the recovery that
                brings the state to the generation's.
            durable: the durable checkpoints (opened on each generation's group).

        Raises:
            RecoveryError: no generation including this worker came in time, or no
                recovery is known for the kind of state held.
            JobEndedError: the job ended while this worker waited.
            StorageFaultError: ``checkpoint.url`` cannot be written, or the checkpoint
                asked for cannot be used (reported: the controller fails the job).
            StateMismatchError: the state a peer sent does not fit this worker's
                (reported as the script's error).
        """
        recovery = self._recovery_of(holdings.kind)
        holds_state = held.has_state
        while True:
            plan, holds_state = self._await_plan(min_generation, held.step, holds_state)
            try:
                return self._join(plan, held, holds_state, recovery, holdings, durable)
            except (RecoveryError, UnequalSitesError) as e:
                log.warning("%s", e)
                uneven = isinstance(e, UnequalSitesError)  # the controller evens the sites
                if uneven:
                    teardown_group()  # nothing was exchanged: the state held is whole
                self._breaks.report(plan.generation, held.step, str(e), False, unequal_sites=uneven)
                min_generation = plan.generation + 1
            except StorageFaultError as e:  # the job's checkpoints, not a peer: the job fails
                log.error("%s", e)
                self._breaks.report(plan.generation, held.step, str(e), False, True, e.fault)
                raise
            except StateMismatchError as e:  # the script's models differ: no peer to wait for
                log.error("%s", e)
                self._breaks.report(plan.generation, held.step, str(e), False, True)
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
        recovery: Recovery,
        holdings: Holdings,
        durable: DurableState,
    ) -> Joined:
        member = plan.member(self._env.node)
        assert member is not None
        rank = member.rank_base + self._env.local_rank
        groups, sockets_before = self._form_group(plan, rank)
        joining = Joining(
            plan=plan,
            rank=rank,
            nproc=member.nproc,
            device=self._plane.device,
            control=groups.control,
            timeout=self._plane.collective_timeout,
            copies_timeout=self._plane.hang_timeout,
            held=held,
            holds_state=holds_state,
            durable=durable,
        )
        try:
            durable.open(first=plan.generation == 1)
            restored = recovery.join(joining, holdings)
        except RuntimeError as e:  # the new group broke already: a member is gone again
            teardown_group()
            raise RecoveryError(
                f"generation {plan.generation}: state sync failed ({e}); a member may be gone"
            ) from e
        self._telemetry.state_source(restored.source, restored.lost)
        return Joined(
            plan=plan,
            rank=rank,
            groups=groups,
            step=restored.step,
            has_state=restored.has_state,
            restored_from=restored.restored_from,
            sockets_before=sockets_before,
        )

    def _form_group(self, plan: Plan, rank: int) -> tuple[Groups, frozenset[int]]:
        """Join ``plan``'s fence and form its process groups as ``rank``; returns them
        and the sockets open before they formed (see :meth:`settled`)."""
        self.joining = (plan.generation, rank, plan.world_size)
        self._fence.join(plan.generation, self._watch.revision_of(plan.generation))
        sockets_before = frozenset(socket_inodes())
        plane = self._plane
        groups = form_group(
            self._client,
            self._env.job,
            plan.generation,
            rank,
            plan.world_size,
            self._env.address,
            collective_timeout=plane.collective_timeout,
            fence=self._fence,
            backend=plane.backend,
            device=plane.device,
        )
        self._telemetry.group_formed(plan.generation)
        publish_environment(plan, self._env.node, rank, *groups.store)
        return groups, sockets_before

    def _recovery_of(self, kind: str) -> Recovery:
        """The recovery of the ``kind`` of state held.

        Raises:
            RecoveryError: the table holds none (the session was built without it).
        """
        recovery = self._recoveries.get(kind)
        if recovery is None:
            known = ", ".join(sorted(self._recoveries)) or "none"
            raise RecoveryError(
                f"no recovery for state of kind {kind!r} (known: {known}); build the "
                "session with agents.runtime.init(), which gives it agents.recovery's table"
            )
        return recovery

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
