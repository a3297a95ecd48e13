"""Reading the world: one job's state in etcd (and its nodes' liveness) as a snapshot.

:func:`read_world` does every read a controller tick needs and returns a
:class:`World`, which the pure policy (:mod:`orchestrator.controller.policy`)
turns into actions.  Every value is a typed record from
:mod:`orchestrator.records`; a malformed record is a
:class:`~orchestrator.records.RecordError` naming its key.

Liveness probes are facts too: when workers reported a broken generation,
each member node none of whose workers reported is probed once on its
agent's liveness port (:mod:`orchestrator.liveness`), and the verdict is part
of the snapshot.  A refused connection means the agent is gone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from orchestrator import events, keys, records
from orchestrator.etcd.client import EtcdClient
from orchestrator.liveness import Liveness, probe
from orchestrator.records import (
    BreakReport,
    CheckpointRecord,
    CommandRecord,
    ControlRecord,
    DoneRecord,
    NodeRecord,
    Plan,
    ProgressRecord,
)

log = logging.getLogger("ringmaster.controller")


@dataclass
class World:
    """What one controller tick knows about a job.

    Attributes:
        now: wall-clock time of the snapshot (``time.time()``).
        mono: monotonic time of the snapshot.
        nodes: registered nodes (leased registrations), by node name.
        progress: workers' heartbeats, by worker id (``<node>-<local rank>``).
        plan: the current generation, None before the job started.
        commands: users' commands to the controller, by key, oldest first.
        control: the requests the workers currently see.
        checkpoint: the newest committed checkpoint, if any.
        done: workers that finished their training loop.
        reports: break reports of the current generation, by worker id.
        dead: member nodes whose agent refused a liveness probe during this break.
        answering: member nodes with a worker whose heartbeat went quiet (older
            than ``quiet_after``) and whose agent answered a liveness probe: the
            silence is that worker's own, not the node's (a partition, a crash).
        silence: the last etcd silence the client recorded (end, seconds), if any.
        startup_failures: before the job started: node → how one of its workers
            exited (the agents' ``WorkerExited`` events of this run).
    """

    now: float
    mono: float
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    progress: dict[str, ProgressRecord] = field(default_factory=dict)
    plan: Plan | None = None
    commands: dict[str, CommandRecord] = field(default_factory=dict)
    control: ControlRecord = field(default_factory=ControlRecord)
    checkpoint: CheckpointRecord | None = None
    done: dict[str, DoneRecord] = field(default_factory=dict)
    reports: dict[str, BreakReport] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    answering: set[str] = field(default_factory=set)
    silence: tuple[float, float] | None = None
    startup_failures: dict[str, str] = field(default_factory=dict)


def workers_of(plan: Plan) -> list[str]:
    """Worker ids of every member of ``plan``, in rank order."""
    return [keys.worker_id(m.node, i) for m in plan.members for i in range(m.nproc)]


def silent_members(plan: Plan, reports: dict[str, BreakReport]) -> set[str]:
    """Members of ``plan`` not all of whose workers reported the break."""
    return {
        m.node
        for m in plan.members
        if not all(keys.worker_id(m.node, i) in reports for i in range(m.nproc))
    }


class WorldReader:
    """Reads snapshots of one job; remembers which nodes it probed in which break."""

    def __init__(
        self, client: EtcdClient, job: str, since: float = 0.0, quiet_after: float = 6.0
    ) -> None:
        self.client = client
        self.job = job
        #: seconds without a heartbeat after which a worker's agent is probed
        self.quiet_after = quiet_after
        self._quiet_probes: dict[str, tuple[float, bool]] = {}
        #: when this run was submitted: older events belong to earlier runs
        self.since = since
        self._probed_generation = -1
        self._probed: set[str] = set()
        self._dead: set[str] = set()

    def commands(self) -> dict[str, CommandRecord]:
        return {
            kv.key: records.decode(CommandRecord, kv.value, kv.key)
            for kv in self.client.get_prefix(keys.job_commands(self.job))
        }

    def read(self) -> World:
        """Everything a tick needs, read now."""
        job = self.job
        world = World(now=time.time(), mono=time.monotonic())
        world.commands = self.commands()
        world.nodes = records.read_all(self.client, keys.job_nodes(job), NodeRecord)
        world.progress = records.read_all(self.client, keys.job_progress(job), ProgressRecord)
        world.plan = records.read(self.client, keys.job_plan(job), Plan)
        world.control = (
            records.read(self.client, keys.job_control(job), ControlRecord) or ControlRecord()
        )
        if world.plan is not None:
            world.checkpoint = records.read(
                self.client, keys.job_checkpoint(job), CheckpointRecord
            )
            world.done = records.read_all(self.client, keys.job_done(job), DoneRecord)
            world.reports = records.read_all(
                self.client, keys.job_reports(job, world.plan.generation), BreakReport
            )
            world.dead = self._probe(world.plan, world.reports, world.nodes)
            world.answering = self._probe_quiet(world.plan, world.progress, world.nodes)
        else:
            world.startup_failures = self._startup_failures()
        world.silence = self.client.last_silence
        # the time of the snapshot is when the reads ended: they may have waited
        # out an etcd outage, and a grace counted from before it would be over
        world.now, world.mono = time.time(), time.monotonic()
        return world

    def _startup_failures(self) -> dict[str, str]:
        """How workers exited before the job started, by node (the first exit of each)."""
        out: dict[str, str] = {}
        for event in events.list_events(self.client, self.job):
            if event.type != "WorkerExited" or event.time < self.since:
                continue
            out.setdefault(event.source, str(event.data.get("error", event.message)))
        return out

    def _probe_quiet(
        self, plan: Plan, progress: dict[str, ProgressRecord], nodes: dict[str, NodeRecord]
    ) -> set[str]:
        """Probe the agents of members with a quiet worker (at most every second)."""
        now, mono = time.time(), time.monotonic()
        quiet = {
            m.node
            for m in plan.members
            for i in range(m.nproc)
            if (p := progress.get(keys.worker_id(m.node, i))) is not None
            and p.generation == plan.generation
            and now - p.beat > self.quiet_after
        }
        answering: set[str] = set()
        for node in sorted(quiet):
            probed_at, answered = self._quiet_probes.get(node, (-1e9, False))
            registration = nodes.get(node)
            if mono - probed_at >= 1.0 and registration is not None and registration.liveness:
                verdict, _ = probe(registration.liveness)
                answered = verdict is Liveness.ALIVE
                self._quiet_probes[node] = (mono, answered)
            if answered:
                answering.add(node)
        return answering

    def _probe(
        self, plan: Plan, reports: dict[str, BreakReport], nodes: dict[str, NodeRecord]
    ) -> set[str]:
        """Probe (once per break) each silent member's agent; the ones that refused."""
        if not reports:
            return set()
        if self._probed_generation != plan.generation:
            self._probed_generation, self._probed, self._dead = plan.generation, set(), set()
        for node in sorted(silent_members(plan, reports) - self._probed):
            self._probed.add(node)
            registration = nodes.get(node)
            if registration is None or not registration.liveness:
                continue
            verdict, _ = probe(registration.liveness)
            log.info("[%s] liveness of %s: %s", self.job, node, verdict.value)
            if verdict is Liveness.DEAD:
                self._dead.add(node)
        return set(self._dead)
