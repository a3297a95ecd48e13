"""Joining a generation, and leaving a broken one for the next.

A generation is the controller's plan of who trains (:class:`Plan`).  To join
one, a worker waits until a plan of at least the generation it needs
includes its node, forms that generation's process group
(:mod:`agents.runtime.process_group`), opens its checkpointer and brings every rank
to the freshest live state (:mod:`agents.recovery.state_sync`), or to the newest
durable checkpoint when no rank holds live state (a fresh or resumed job).
A sharded model gets its slices instead (:mod:`agents.recovery.shard_recovery`).

When a generation breaks (a peer is gone, or the controller switched to a
new plan), the worker drops its DDP and group, reports the break (a
:class:`BreakReport`, keyed by generation, so a late report can never affect
a newer one: through its node agent, which writes one record for its
workers, or under the generation's ``reports/`` prefix itself) and joins the
next.  A group that does not form is reported like a broken generation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from agents.api import JobEndedError, RecoveryError
from agents.recovery import shard_recovery
from agents.recovery.state_sync import NO_STATE, sync_state
from agents.runtime.process_group import (
    form_group,
    hang_up,
    socket_inodes,
    sockets_opened_since,
    teardown_group,
)
from orchestrator import keys, records
from orchestrator.api import EtcdError, EtcdUnavailableError
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.records import BreakReport, JobStatus, Plan, RecordError
from orchestrator.settings import SETTINGS

if TYPE_CHECKING:
    from agents.runtime.session import Session
    from orchestrator.etcd.client import EtcdClient

log = logging.getLogger("ringmaster.worker")

#: A step that fails this many times in a row is not a peer failure: give up.
MAX_FAILURES_PER_STEP = 5


class Generations:
    """Moves one worker from generation to generation (see the module docstring)."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self.failures_at_step = 0

    # -- leaving -----------------------------------------------------------------------

    def recover(self, reason: str, planned: bool = False) -> None:
        """Leave the current generation and join the next one.

        Raises:
            RecoveryError: the same step failed too often, or no generation came.
            JobEndedError: the job ended while this worker waited.
        """
        s = self._s
        started = time.monotonic()
        self.failures_at_step += 0 if planned else 1
        if self.failures_at_step > MAX_FAILURES_PER_STEP:
            raise RecoveryError(
                f"step {s.step} failed {self.failures_at_step} times in a row; last: {reason}"
            )
        s.recoveries += 0 if planned else 1
        log.warning("generation %d ends: %s", s.generation, reason)
        s.hook = None
        s.collective_guard.detach()
        for w in s.wrapped:
            w.drop()
        if s.sharded is not None:
            s.sharded.drop()
        if not planned and s.groups is not None:
            # a local survivor may wait on this rank in a collective: end its wait now
            # (hang_up), not at its operation timeout
            hang_up(s.groups.sockets)
        if s.buddies is not None:
            s.buddies.stop()  # before the group goes: its exchange may wait on the dead peer
        teardown_group()
        s.groups = None
        self.report(s.generation, reason, planned)
        self.join_next(s.generation + 1)
        s.last_recovery_s = time.monotonic() - started
        log.warning(
            "rejoined as rank %d/%d in generation %d at step %d (%.3fs)",
            s.rank,
            s.world_size,
            s.generation,
            s.step,
            s.last_recovery_s,
        )

    def report(self, generation: int, reason: str, planned: bool, user_error: bool = False) -> None:
        """Tell the controller that ``generation`` broke here (best effort)."""
        s = self._s
        report = BreakReport(
            step=s.step, reason=reason, planned=planned, at=time.time(), user_error=user_error
        )
        if s.heartbeat.relay_report(generation, report):
            return  # the node agent wrote it, with its other workers' (agents.node.break_reports)
        try:
            records.write(s.client, keys.job_reports(s.env.job, generation) + s.worker, report)
        except EtcdError as e:
            log.warning("could not report the end of generation %d: %s", generation, e)

    # -- joining -----------------------------------------------------------------------

    def join_next(self, min_generation: int) -> None:
        """Join the first generation from ``min_generation`` on whose group forms.

        A group that does not form (a member died or came too late) is
        reported like a broken generation, and the worker waits for the next.
        """
        while True:
            plan = self._await_plan(min_generation)
            try:
                self._join(plan)
                return
            except RecoveryError as e:
                log.warning("%s", e)
                self.report(plan.generation, str(e), False)
                min_generation = plan.generation + 1

    def _await_plan(self, min_generation: int) -> Plan:
        """Block until a plan of at least ``min_generation`` that includes this worker."""
        s = self._s
        timeout = SETTINGS.plan_timeout.total_seconds()
        deadline = time.monotonic() + timeout
        while True:
            plan = s.watch.wait_newer(min_generation - 1, timeout=1.0)
            if plan is not None:
                member = plan.member(s.env.node)
                if member is not None and s.env.local_rank < member.nproc:
                    return plan
                if s.has_state and s.generation > 0:
                    # Replaced while away (partitioned, or too slow): the state held
                    # here is stale.  Drop it and wait as a spare that gets live state.
                    log.warning(
                        "fenced out: generation %d does not include this node; "
                        "dropping the state of step %d and waiting as a spare",
                        plan.generation,
                        s.step,
                    )
                    s.has_state = False
                    s.fence.leave()
                min_generation = plan.generation + 1  # not in it: wait as a spare
            status = self._job_status()
            if status is not None and status.phase.terminal:
                raise JobEndedError(f"job {s.env.job} is {status.phase.value}")
            if time.monotonic() > deadline:
                raise RecoveryError(
                    f"no generation >= {min_generation} including {s.worker} within "
                    f"{timeout:g}s (RINGMASTER_PLAN_TIMEOUT)"
                )

    def _job_status(self) -> JobStatus | None:
        s = self._s
        try:
            return records.read(s.client, keys.job_status(s.env.job), JobStatus)
        except (EtcdError, RecordError) as e:
            log.debug("job phase unknown: %s", e)
            return None

    def _join(self, plan: Plan) -> None:
        s = self._s
        member = plan.member(s.env.node)
        assert member is not None
        s.generation = plan.generation
        s.plan = plan
        s.rank = member.rank_base + s.env.local_rank
        s.world_size = plan.world_size
        s.fence.join(plan.generation, s.watch.revision_of(plan.generation))
        sockets_before = socket_inodes()
        groups = form_group(
            s.client,
            s.env.job,
            plan.generation,
            s.rank,
            s.world_size,
            s.env.address,
            collective_timeout=s.spec.fault_tolerance.hang_timeout * 2,
            fence=s.fence,
            backend=s.backend,
            device=s.device,
        )
        s.groups = groups
        s.telemetry.group_formed(plan.generation)
        _publish_environment(plan, s.env.node, s.rank, *groups.store)
        try:
            s.saving.open(first=plan.generation == 1)
            if s.sharded is not None:
                shard_recovery.join(s, s.sharded, groups.control)
                if s.buddies is not None:
                    s.buddies.start(
                        s.rank,
                        s.world_size,
                        member.nproc,
                        shard_recovery.layouts(s, s.sharded),
                        s.sharded.rows,
                        s.spec.fault_tolerance.hang_timeout,
                    )
            else:
                mine = s.step if s.has_state else NO_STATE
                result = sync_state(mine, self._capture, self._restore, group=groups.control)
                if result.step != NO_STATE:
                    s.step = result.step
                    s.has_state = True
                elif s.saving.train_state() is not None:
                    s.saving.resume()
        except RuntimeError as e:  # the new group broke already: a member is gone again
            teardown_group()
            raise RecoveryError(
                f"generation {plan.generation}: state sync failed ({e}); a member may be gone"
            ) from e
        s.telemetry.state_restored(s.step)
        s.vote_at = 0  # a generation votes at its first boundary, on every rank
        for w in s.wrapped:
            w.rebuild()
        groups = dataclasses.replace(
            groups, sockets=sockets_opened_since(sockets_before, _etcd_ports(s.client))
        )
        s.groups = groups
        s.heartbeat.start()
        s.heartbeat.poke()
        s.collective_guard.attach(groups, plan.generation)

    def _capture(self) -> dict[str, Any]:
        s = self._s
        return {
            "step": s.step,
            "tracked": {name: obj.state_dict() for name, obj in s.tracked.items()},
            "rng": torch.get_rng_state(),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        s = self._s
        for name, obj in s.tracked.items():
            if name in state["tracked"]:
                obj.load_state_dict(state["tracked"][name])
        torch.set_rng_state(state["rng"])
        s.step = int(state["step"])
        s.has_state = True

    # -- etcd outages ------------------------------------------------------------------

    def pause_for_etcd(self) -> None:
        """Wait, state kept, until etcd answers again (every rank pauses at this step).

        Training on without etcd would go unnoticed by the controller and could
        not be fenced, so an outage pauses the job instead of failing it.

        Raises:
            RecoveryError: etcd stayed away for ``RINGMASTER_PLAN_TIMEOUT``.
        """
        s = self._s
        started = time.monotonic()
        s.paused = f"etcd unreachable at step {s.step}"
        log.warning("%s: pausing until etcd is back", s.paused)
        try:

            def back() -> None:
                _check_writable(s.client)  # a read answers under NOSPACE; wait for writes
                s.watch.load()

            retry_unavailable(
                back,
                f"paused at step {s.step}",
                max_wait=SETTINGS.plan_timeout,
            )
        except EtcdError as e:
            raise RecoveryError(
                f"etcd stayed unreachable for {SETTINGS.plan_timeout.total_seconds():g}s "
                f"(RINGMASTER_PLAN_TIMEOUT) while paused at step {s.step}: {e}"
            ) from e
        finally:
            s.paused = None
        log.warning(
            "etcd is back; resuming at step %d after %.1fs",
            s.step,
            time.monotonic() - started,
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


def _publish_environment(plan: Plan, node: str, rank: int, host: str, port: int) -> None:
    """Keep torchrun's variables true for this generation, for libraries that read them.

    After a hot-swap a worker's global rank, the world size and the store's
    address change; code that reads ``RANK`` or ``MASTER_ADDR`` (loggers,
    data libraries, a second ``init_process_group`` of the script's own) sees
    the current generation, not the one the worker started in.
    """
    member = plan.member(node)
    assert member is not None
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(plan.world_size),
            "GROUP_RANK": str(plan.members.index(member)),
            "GROUP_WORLD_SIZE": str(len(plan.members)),
            "LOCAL_WORLD_SIZE": str(member.nproc),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
        }
    )
