"""One job's controller: read the world, decide, apply the decisions.

:class:`JobController` holds the job's status and the policy's memory.  Each
:meth:`~JobController.tick` reads a snapshot (:mod:`orchestrator.controller.world`),
asks the pure policy (:mod:`orchestrator.controller.policy`) what to do, and
applies the actions it returns to etcd, the event log and the observer
(:mod:`orchestrator.observe.job_observer`).  Everything it knows lives in
etcd, so a standby that takes over simply reads it back.

It also holds the job's checkpoint root for the run
(:mod:`orchestrator.checkpoint_root.writer_hold`):
the policy decides nothing, so no plan is published and no worker trains,
until the root is taken; a root that a live run of another lineage writes
(or that cannot be written) fails the job with the reason in one line, and
so does losing the root to another run.  The root is released when the job
ends; a controller that merely stops leaves the marker to its successor (the
same lineage takes it at once) or to go stale.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from orchestrator.api import JobPhase
from orchestrator.checkpoint_root.writer_hold import (
    FIRST_WAIT_S,
    HOLD_WAIT_S,
    HeldRoot,
    HoldState,
    hold_for,
    root_url,
)
from orchestrator.controller import policy
from orchestrator.controller.actions import (
    Action,
    CheckpointCommitted,
    DeclareFailed,
    DeleteCommand,
    Emit,
    FailureSeen,
    KillWorker,
    PhaseChanged,
    ProbeLinks,
    PublishPlan,
    Recovered,
    ReleaseNode,
    WriteControl,
)
from orchestrator.controller.hangs import STALE_BEATS
from orchestrator.controller.link_prober import LinkProber
from orchestrator.controller.node_watch import NodeWatch
from orchestrator.controller.plans import restart_tier
from orchestrator.controller.straggler_swaps import decide_stragglers
from orchestrator.controller.stragglers import StragglerWatch
from orchestrator.controller.world import World, WorldReader, read_reports
from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.job_observer import JobObserver
from orchestrator.observe.metrics import JobMetrics
from orchestrator.state import events, keys, records
from orchestrator.state.jobs import read_spec, read_status
from orchestrator.state.records import JobStatus, NodeRecord, Plan, ProgressRecord, Telemetry
from orchestrator.state.runs import lineage_id

log = logging.getLogger("ringmaster.controller")

#: The leader writes the job's status at least this often, also when nothing changed
#: (its ``led_at``), so ``ringmaster status`` can tell when no controller leads the job.
STATUS_REFRESH = timedelta(seconds=2)


class JobController:
    """Reconciles one job; :meth:`tick` is called whenever something may have changed."""

    def __init__(
        self,
        client: EtcdClient,
        job: str,
        metrics: JobMetrics | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        """``wake``: asks for a tick at once (an agent was found gone between ticks)."""
        self.client = client
        self.job = job
        self.spec, self.spec_hash = read_spec(client, job)
        self.observer = JobObserver(client, job, metrics)
        #: the run of the job this controller runs (a resubmit starts a new one)
        self.run = self.observer.run
        self.status = read_status(client, job) or JobStatus(job, run=self.run)
        self.observer.adopt(self.status)
        self.reader = WorldReader(
            client,
            job,
            since=self.observer.submitted_at,
            watch=NodeWatch(on_gone=wake),
        )
        self.memory = policy.Memory(silence_seen=client.last_silence)
        # a node quarantined under an earlier leader stays so (its registration is read
        # again at the first tick: a restarted agent releases it)
        self._follow_spec({n: None for n in self.status.quarantined})
        self.prober = LinkProber(client, job)
        self.metrics = metrics
        self._last_written: dict[str, Any] = {}
        #: this run's hold on the checkpoint root (the controller runs where the job's
        #: processes start, so a relative ``checkpoint.url`` is read from its directory)
        self.writer: HeldRoot = hold_for(
            root_url(self.spec.checkpoint.url, os.getcwd()),
            lineage_id(client, job),
            job,
            self.run,
            ",".join(client.endpoints),
        )

    def take_spec(self) -> None:
        """The run's spec changed in place (the operator's update of a TrainingJob):
        decide by it from now on.  What this controller keeps of the run stays: its
        memory (restarts used, hang watches, timers), the checkpoint root it holds (the
        workers write there until they start again); what it derives from the spec
        follows it (how long a worker may be quiet, the straggler rule)."""
        self.spec, self.spec_hash = read_spec(self.client, self.job)
        self._follow_spec(self.stragglers.quarantined)

    def _follow_spec(self, quarantined: dict[str, float | None]) -> None:
        """What the controller derives from ``self.spec``: how long a worker may be
        quiet, and the straggler rule (keeping the nodes it has ``quarantined``)."""
        ft = self.spec.fault_tolerance
        self.reader.quiet_after = STALE_BEATS * ft.heartbeat_interval.total_seconds()
        self.stragglers = StragglerWatch(ft.stragglers, ft.heartbeat_interval.total_seconds())
        self.stragglers.quarantined = quarantined

    def tick(self) -> None:
        if self.status.phase.terminal:
            self._end_watch()
            self.writer.close(release=True)
            return
        if not self._root_held():
            return
        world = self.reader.read()
        world.quarantined = set(self.stragglers.quarantined)
        world.link_probe = self.prober.take()
        decision = policy.decide(self.spec, self.memory, self.status, world)
        self.memory = decision.memory
        self.status = decision.status
        actions = decision.actions
        actions += decide_stragglers(
            self.spec, self.stragglers, self.status, world, actions, self.memory.equal_sites
        )
        self._apply(actions, world)
        if world.plan is not None and not any(isinstance(a, PublishPlan) for a in actions):
            plan: Plan | None = world.plan
        else:
            plan = records.read(self.client, keys.job_plan(self.job), Plan)
        self.observer.observe(self.status, plan, world.nodes, world.progress)
        if self.metrics is not None:  # each node's step time and slowdown, last window
            for node, t in self.stragglers.timings.items():
                slowdown = self.stragglers.slowdowns.get(node)
                self.metrics.node_timing(self.job, node, t.compute_s, slowdown)
            if world.link_probe is not None:
                self.metrics.link_rates(self.job, world.link_probe.rates)
        self._write_status()
        if self.status.phase.terminal:
            self._end_watch()
            self.writer.close(release=True)

    def close(self, wait: float = 0.0) -> None:
        """Stop renewing the root's heartbeat (a controller that stops; the job goes on),
        waiting up to ``wait`` seconds for a release the job's end asked for; stop
        watching the agents."""
        self._end_watch()
        self.writer.close(release=False)
        self.writer.join(wait)

    def _end_watch(self) -> None:
        if self.reader.watch is not None:
            self.reader.watch.close()
            self.reader.watch = None

    def _root_held(self) -> bool:
        """Whether this run holds its checkpoint root; ends the job when it cannot."""
        writer = self.writer
        writer.start(wait=FIRST_WAIT_S)  # a store that answers at once: the plan goes out now
        if writer.state is HoldState.HELD:
            if writer.note is not None:
                log.warning("[%s] %s", self.job, writer.note)
                events.emit(self.client, self.job, "CheckpointRootTakenOver", writer.note)
                writer.note = None
            return True
        if writer.state is HoldState.PENDING:
            assert writer.started_at is not None
            if time.monotonic() - writer.started_at <= HOLD_WAIT_S:
                return False
            message = (
                f"checkpoint.url {writer.hold.url} did not answer within {HOLD_WAIT_S:g}s "
                "while the job's writer marker was written there: check the storage "
                "endpoint, or give this job another checkpoint.url"
            )
        else:
            message = writer.message or f"checkpoint.url {writer.hold.url} is not this run's"
        writer.close(release=False)
        self.status.phase = JobPhase.FAILED
        self.status.message = message
        events.emit(self.client, self.job, "Phase", f"{JobPhase.FAILED.value}: {message}")
        log.warning("[%s] %s: %s", self.job, JobPhase.FAILED.value, message)
        self._write_status()
        return False

    # -- the executor ------------------------------------------------------------------

    def _apply(self, actions: list[Action], world: World) -> None:
        for action in actions:
            self._apply_one(action, world)

    def _apply_one(self, action: Action, world: World) -> None:
        client, job = self.client, self.job
        if isinstance(action, DeleteCommand):
            client.delete(action.key)
        elif isinstance(action, WriteControl):
            records.write(client, keys.job_control(job), action.control)
        elif isinstance(action, Emit):
            events.emit(client, job, action.type, action.message, **action.data)
        elif isinstance(action, PhaseChanged):
            # the event and the status in one write: a leader that dies between the two
            # would leave its successor to record the phase again
            event = events.Event(
                type="Phase",
                message=f"{action.phase.value}: {action.message}",
                source="controller",
                data=dict(action.data),
            )
            log.warning("[%s] %s: %s", job, action.phase.value, action.message)
            self._write_status(with_event=event)
        elif isinstance(action, PublishPlan):
            self._publish(action.plan)
        elif isinstance(action, FailureSeen):
            self.observer.failure_seen(action.reports, action.step)
        elif isinstance(action, DeclareFailed):
            cause = self.observer.declared(
                set(action.nodes),
                action.why,
                world.nodes,
                action.step,
                set(action.agent_gone),
                at=world.now,  # when the snapshot it was decided on was read
                seen_at=action.seen_at,
                spare_wait_s=action.spare_wait_s,
            )
            who = ", ".join(sorted(action.nodes)) or "no node"
            log.warning("[%s] %s failed: %s (%s)", job, who, action.why, cause)
            for node in sorted(action.nodes):
                events.emit(
                    client,
                    job,
                    "NodeFailed",
                    f"{node}: {action.why} ({cause})",
                    node=node,
                    cause=cause,
                )
        elif isinstance(action, Recovered):
            progress = world.progress
            if restart_tier(self.spec, world.nodes):
                progress = launched(action.plan, world.nodes)
            broke_at = None
            if self.observer.unreported():  # the survivors' reports came after the plan
                late = read_reports(client, job, action.plan.generation - 1).values()
                broke_at = min((r.step for r in late if not r.planned), default=None)
            record = self.observer.recovered(self.status, action.plan, progress, broke_at)
            if record is not None:
                log.warning(
                    "[%s] recovered: generation %d trains again %.2fs after the failure (%s)",
                    job,
                    record.generation,
                    record.total_s,
                    record.cause,
                )
        elif isinstance(action, CheckpointCommitted):
            r = action.record
            if action.late:
                events.emit(
                    client,
                    job,
                    "Checkpoint",
                    f"step {r.step} committed to {r.url} ({r.reason}), "
                    f"{max(0.0, time.time() - r.at):.0f}s ago while no controller led the job",
                    step=r.step,
                    committed_at=r.at,
                )
                return
            events.emit(
                client,
                job,
                "Checkpoint",
                f"step {r.step} committed to {r.url} ({r.reason})",
                step=r.step,
                **self.observer.checkpoint(world.progress),
            )
        elif isinstance(action, KillWorker):
            records.write(
                client,
                keys.agent_commands(job, action.node) + f"{time.time_ns():020d}",
                action.command,
            )
            events.emit(
                client,
                job,
                "WorkerHung",
                action.message,
                worker=action.worker,
                silent_since=action.silent_since,
            )
        elif isinstance(action, ReleaseNode):
            pass  # applied by the straggler decisions (no I/O)
        elif isinstance(action, ProbeLinks):
            self.prober.start(action.ports)
        else:  # pragma: no cover - every action kind is handled above
            raise TypeError(f"unknown controller action {action!r}")

    def _publish(self, plan: Plan) -> None:
        records.write(self.client, keys.job_plan(self.job), plan)
        # the break reports of generations before the previous one are read no more:
        # a crash at 1,000 x 8 leaves 1.1 MB of them, and a long job has many
        for old in keys.stale_report_prefixes(self.job, plan.generation):
            self.client.delete_prefix(old)
        members = ", ".join(m.node for m in plan.members)
        log.warning("[%s] generation %d: %s (%s)", self.job, plan.generation, members, plan.reason)
        events.emit(
            self.client,
            self.job,
            "Generation",
            f"generation {plan.generation}: {members} ({plan.reason})",
            generation=plan.generation,
        )

    def _write_status(self, with_event: events.Event | None = None) -> None:
        """Write the status if it changed or is due for a refresh (``with_event``: and
        append that event, in the same transaction: both or neither)."""
        data = self.status.to_dict()
        comparable = {k: v for k, v in data.items() if k not in ("updated_at", "led_at")}
        now = time.time()
        changed = comparable != self._last_written
        if with_event is None and (
            not changed and now - self.status.led_at < STATUS_REFRESH.total_seconds()
        ):
            return
        self._last_written = comparable
        if changed:
            self.status.updated_at = now
        self.status.led_at = now
        status = (keys.job_status(self.job), self.status.encode())
        if with_event is None:
            self.client.put(*status)
            return
        key, value = events.entry(self.job, with_event)
        self.client.put_many([(status[0], status[1].encode()), (key, value.encode())])
        events.trim(self.client, self.job)


def launched(plan: Plan, nodes: dict[str, NodeRecord]) -> dict[str, ProgressRecord]:
    """Restart tier: each worker of ``plan`` as its agent's registration saw it launched.

    The scripts report no steps.  The moment the last agent started the new
    generation's workers stands for the group formed; the first line of output
    any of them printed since (``NodeRecord.progress_at``) stands for the state
    restored and the first step (phases the scripts do not tell apart).  Where
    no agent saw output, the launch stands for all three.
    """
    out: dict[str, ProgressRecord] = {}
    told = [
        info.progress_at
        for m in plan.members
        if (info := nodes.get(m.node)) is not None
        and info.generation == plan.generation
        and info.progress_at
    ]
    for m in plan.members:
        info = nodes.get(m.node)
        if info is None or info.generation != plan.generation or info.launched_at is None:
            continue
        at = info.launched_at
        first = max(at, min(told)) if told else at
        tel = Telemetry(
            generation=plan.generation, group_formed_at=at, restored_at=first, first_step_at=first
        )
        for i in range(m.nproc):
            out[keys.worker_id(m.node, i)] = ProgressRecord(
                step=0,
                generation=plan.generation,
                rank=m.rank_base + i,
                world_size=plan.world_size,
                pid=info.pid,
                beat=at,
                step_time=at,
                telemetry=tel,
            )
    return out
