"""Reading the world: one job's state in etcd (and its nodes' liveness) as a snapshot.

:meth:`WorldReader.read` does every read a controller tick needs and returns a
:class:`World`, which the pure policy (:mod:`orchestrator.controller.policy`)
turns into actions.  Every value is a typed record from
:mod:`orchestrator.state.records`; a malformed record is a
:class:`~orchestrator.state.records.RecordError` naming its key.

Liveness probes are facts too: when workers reported a broken generation,
each member node none of whose workers reported is probed once on its
agent's liveness port (:mod:`orchestrator.ports.liveness`), and the verdict is part
of the snapshot.  A refused connection means the agent is gone.  So does a
watch connection that closed unannounced (:mod:`orchestrator.controller.node_watch`),
which needs no report first.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from orchestrator.controller.node_watch import NodeWatch
from orchestrator.controller.slow_links import LinkProbeResult
from orchestrator.etcd.client import EtcdClient
from orchestrator.ports.liveness import Liveness, probe
from orchestrator.state import events, keys, records
from orchestrator.state.records import (
    BreakReport,
    CheckpointRecord,
    CommandRecord,
    ControlRecord,
    DoneRecord,
    NodeBreakReports,
    NodeProgressRecord,
    NodeRecord,
    Plan,
    ProgressRecord,
)

log = logging.getLogger("ringmaster.controller")

R = TypeVar("R", bound=records.Record)

#: Liveness probes of one tick run at once, at most this many at a time.
PROBE_THREADS = 16
#: After a break's first report, how long its silent members are left to report before
#: they are probed, while more of them are silent than one round of probes covers.
PROBE_SETTLE_S = 0.5
#: While a break is handled, how old a read of the workers' progress may be reused.
PROGRESS_REUSE_S = 1.0
#: How often the agent of a member with a quiet worker is probed, at most (and at most
#: every heartbeat interval: ``WorldReader.quiet_after`` / ``QUIET_BEATS``).
PROBE_EVERY_S = 1.0
QUIET_BEATS = 3


@dataclass
class World:
    """What one controller tick knows about a job.

    Attributes:
        now: wall-clock time of the snapshot (``time.time()``).
        mono: monotonic time of the snapshot.
        nodes: registered nodes (leased registrations), by node name.
        progress: workers' heartbeats, by worker id (``<node>-<local rank>``), from
            their nodes' records (:func:`read_progress`).
        plan: the current generation, None before the job started.
        commands: users' commands to the controller, by key, oldest first.
        control: the requests the workers currently see.
        checkpoint: the newest committed checkpoint, if any.
        done: workers that finished their training loop.
        reports: break reports of the current generation, by worker id.
        dead: member nodes whose agent refused a liveness probe during this break.
        closed: registered nodes whose agent's watch connection closed unannounced (the
            agent's process is gone: :mod:`orchestrator.controller.node_watch`), with
            when that was seen (wall clock).
        alive: member nodes whose agent answered a liveness probe during this break
            (probed while they had not reported: their reports may still be on the way).
        answering: member nodes with a worker whose heartbeat went quiet (older
            than ``quiet_after``) and whose agent answered a liveness probe: the
            silence is that worker's own, not the node's (a partition, a crash).
        probed_at: when the answer each of those agents gave was asked for
            (``time.monotonic()``).
        silence: the last etcd silence the client recorded (end, seconds), if any.
        startup_failures: before the job started: node → how one of its workers
            exited (the agents' ``WorkerExited`` events of this run).
        quarantined: nodes swapped out for being slow: never warm spares
            (:mod:`orchestrator.controller.straggler_swaps`).
        link_probe: the links the agents measured since the last tick, if a probe
            ended (:mod:`orchestrator.controller.slow_links`).
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
    closed: dict[str, float] = field(default_factory=dict)
    alive: set[str] = field(default_factory=set)
    answering: set[str] = field(default_factory=set)
    probed_at: dict[str, float] = field(default_factory=dict)
    silence: tuple[float, float] | None = None
    startup_failures: dict[str, str] = field(default_factory=dict)
    quarantined: set[str] = field(default_factory=set)
    link_probe: LinkProbeResult | None = None

    @property
    def agents_gone(self) -> set[str]:
        """Nodes whose agent is known gone first-hand: a refused probe or a closed watch."""
        return self.dead | self.closed.keys()


class RecordCache(Generic[R]):
    """The records under one prefix, decoded again only where a key's revision moved.

    A tick reads every record, but most did not change since the last tick
    (a node's progress is written about once a second): their decoded record
    is kept by ``mod_revision`` and handed out again.  Records handed out are
    shared between ticks: the controller never changes one it read.
    """

    def __init__(self, cls: type[R]) -> None:
        self.cls = cls
        self._seen: dict[str, tuple[int, R]] = {}

    def read(self, client: EtcdClient, prefix: str) -> dict[str, R]:
        """Every record under ``prefix``, by the last segment of its key (in key order)."""
        seen: dict[str, tuple[int, R]] = {}
        for kv in client.get_prefix(prefix):
            hit = self._seen.get(kv.key)
            if hit is None or hit[0] != kv.mod_revision:
                hit = (kv.mod_revision, records.decode(self.cls, kv.value, kv.key))
            seen[kv.key] = hit
        self._seen = seen
        return {key.rsplit("/", 1)[1]: record for key, (_, record) in seen.items()}


def read_progress(
    client: EtcdClient,
    job: str,
    caches: tuple[RecordCache[ProgressRecord], RecordCache[NodeProgressRecord]] | None = None,
) -> dict[str, ProgressRecord]:
    """Every worker's latest progress, by worker id (``<node>-<local rank>``).

    Agents write one record per node holding their workers' records
    (:mod:`agents.node.progress_relay`); a worker started without an agent writes
    its own.  Where both hold a worker, the newer beat wins.

    Args:
        caches: decoded records kept from the last read (a controller's), if any.
    """
    workers, nodes = caches or (RecordCache(ProgressRecord), RecordCache(NodeProgressRecord))
    out = workers.read(client, keys.job_progress(job))
    for node in nodes.read(client, keys.job_node_progress(job)).values():
        for worker, p in node.workers.items():
            if (had := out.get(worker)) is None or p.beat >= had.beat:
                out[worker] = p
    return out


def read_reports(
    client: EtcdClient,
    job: str,
    generation: int,
    caches: tuple[RecordCache[BreakReport], RecordCache[NodeBreakReports]] | None = None,
) -> dict[str, BreakReport]:
    """Every worker's report that ``generation`` broke, by worker id.

    Agents write one record per node for the workers that reported through
    them (:mod:`agents.node.break_reports`); a worker whose agent did not take its
    report writes its own.  Where both hold a worker, its own is kept.

    Args:
        caches: decoded records kept from the last read (a controller's), if any.
    """
    workers, nodes = caches or (RecordCache(BreakReport), RecordCache(NodeBreakReports))
    out = workers.read(client, keys.job_reports(job, generation))
    for node in nodes.read(client, keys.job_node_reports(job, generation)).values():
        for worker, report in node.workers.items():
            out.setdefault(worker, report)
    return out


def workers_of(plan: Plan) -> list[str]:
    """Worker ids of every member of ``plan``, in rank order."""
    return [w for m in plan.members for w in keys.worker_ids(m.node, m.nproc)]


def silent_members(plan: Plan, reports: dict[str, BreakReport]) -> set[str]:
    """Members of ``plan`` not all of whose workers reported the break."""
    return {
        m.node
        for m in plan.members
        if not all(w in reports for w in keys.worker_ids(m.node, m.nproc))
    }


class WorldReader:
    """Reads snapshots of one job; remembers which nodes it probed in which break."""

    def __init__(
        self,
        client: EtcdClient,
        job: str,
        since: float = 0.0,
        quiet_after: float = 6.0,
        watch: NodeWatch | None = None,
    ) -> None:
        self.client = client
        self.job = job
        #: the registered agents' watch connections, if this reader keeps them
        self.watch = watch
        #: seconds without a heartbeat after which a worker's agent is probed
        self.quiet_after = quiet_after
        #: node -> (when probed, monotonic; whether its agent answered; the latest beat
        #: of each of its workers as the agent received it)
        self._quiet_probes: dict[str, tuple[float, bool, dict[str, float]]] = {}
        #: when this run was submitted: older events belong to earlier runs
        self.since = since
        #: the generation whose break is being handled (reports of it were read)
        self._probed_generation = -1
        self._probed: set[str] = set()
        #: when the break being probed was first reported (monotonic)
        self._first_report = 0.0
        self._dead: set[str] = set()
        self._alive: set[str] = set()
        self._reports = (RecordCache(BreakReport), RecordCache(NodeBreakReports))
        self._progress = (RecordCache(ProgressRecord), RecordCache(NodeProgressRecord))
        self._nodes = RecordCache(NodeRecord)
        #: the last read of the workers' progress (monotonic time, records)
        self._progress_read: tuple[float, dict[str, ProgressRecord]] = (-1e9, {})

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
        world.nodes = self._nodes.read(self.client, keys.job_nodes(job))
        if self.watch is not None:
            self.watch.follow({n: r.liveness for n, r in world.nodes.items() if r.liveness})
            world.closed = self.watch.gone()
        world.plan = records.read(self.client, keys.job_plan(job), Plan)
        world.progress = self._read_progress(world.plan)
        world.control = (
            records.read(self.client, keys.job_control(job), ControlRecord) or ControlRecord()
        )
        if world.plan is not None:
            world.checkpoint = records.read(self.client, keys.job_checkpoint(job), CheckpointRecord)
            world.done = records.read_all(self.client, keys.job_done(job), DoneRecord)
            world.reports = read_reports(self.client, job, world.plan.generation, self._reports)
            world.dead, world.alive = self._probe(world.plan, world.reports, world.nodes)
            world.answering, beats, world.probed_at = self._probe_quiet(
                world.plan, world.progress, world.nodes
            )
            world.progress = with_newer_beats(world.progress, beats)
        else:
            world.startup_failures = self._startup_failures()
        world.silence = self.client.last_silence
        # the time of the snapshot is when the reads ended: they may have waited
        # out an etcd outage, and a grace counted from before it would be over
        world.now, world.mono = time.time(), time.monotonic()
        return world

    def _read_progress(self, plan: Plan | None) -> dict[str, ProgressRecord]:
        """Every worker's progress: read again, unless a break of ``plan`` is being
        handled and the last read is under :data:`PROGRESS_REUSE_S` old.

        While a generation breaks the ticks come as fast as the reports land, and
        the node-progress range is the largest read of a tick (4.8 MB at 1,000 x 8);
        a break's decision needs of it only whether the spares are warm.
        """
        mono = time.monotonic()
        if (
            plan is not None
            and self._probed_generation == plan.generation  # its break is being handled
            and mono - self._progress_read[0] < PROGRESS_REUSE_S
        ):
            return self._progress_read[1]
        progress = read_progress(self.client, self.job, self._progress)
        self._progress_read = (mono, progress)
        return progress

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
    ) -> tuple[set[str], dict[str, float], dict[str, float]]:
        """Probe the agents of members with a quiet worker (at most every second, and
        every heartbeat interval where that is shorter).

        Returns the members whose agent answered, the latest beat of each of their
        workers as the agent received it (a worker's beat can be stale in etcd only
        because its agent's writes wait: on an etcd leader election, say), and when
        each answer was asked for.
        """
        now, mono = time.time(), time.monotonic()
        every = min(PROBE_EVERY_S, self.quiet_after / QUIET_BEATS)
        quiet = {
            m.node
            for m in plan.members
            for worker in keys.worker_ids(m.node, m.nproc)
            if (p := progress.get(worker)) is not None
            and p.generation == plan.generation
            and now - p.beat > self.quiet_after
        }
        due = {
            node: address
            for node in sorted(quiet)
            if mono - self._quiet_probes.get(node, (-1e9, False))[0] >= every
            and (address := _liveness(nodes, node))
        }
        for node, (verdict, answer) in probe_answers(due).items():
            self._quiet_probes[node] = (mono, verdict is Liveness.ALIVE, _agent_beats(answer))
        answering, beats, asked = set(), {}, {}
        for node in quiet:
            at, alive, agent_beats = self._quiet_probes.get(node, (0.0, False, {}))
            if alive:
                answering.add(node)
                beats.update(agent_beats)
                asked[node] = at
        return answering, beats, asked

    def _probe(
        self, plan: Plan, reports: dict[str, BreakReport], nodes: dict[str, NodeRecord]
    ) -> tuple[set[str], set[str]]:
        """Probe (once per break) each silent member's agent: (refused, answered).

        While more members are silent than :data:`PROBE_THREADS` probe in one round,
        they get :data:`PROBE_SETTLE_S` from the break's first report to report
        first: the probes then go to the few that did not (the dead), not to every
        member whose report was on its way.
        """
        if not reports:
            return set(), set()
        mono = time.monotonic()
        if self._probed_generation != plan.generation:
            self._probed_generation, self._probed = plan.generation, set()
            self._dead, self._alive = set(), set()
            self._first_report = mono
        silent = sorted(silent_members(plan, reports) - self._probed)
        if len(silent) > PROBE_THREADS and mono - self._first_report < PROBE_SETTLE_S:
            # the other survivors' reports are still landing (at a thousand nodes they
            # take a while): probe the few left silent, not every member
            return set(self._dead), set(self._alive)
        self._probed.update(silent)
        due = {node: address for node in silent if (address := _liveness(nodes, node))}
        started = time.monotonic()
        verdicts = probe_all(due)
        for node, verdict in verdicts.items():
            if verdict is Liveness.DEAD:
                log.info("[%s] liveness of %s: %s", self.job, node, verdict.value)
                self._dead.add(node)
            elif verdict is Liveness.ALIVE:
                self._alive.add(node)
        if verdicts:
            log.info(
                "[%s] probed %d silent member(s) in %.3fs: %d refused, %d answered",
                self.job,
                len(verdicts),
                time.monotonic() - started,
                sum(v is Liveness.DEAD for v in verdicts.values()),
                sum(v is Liveness.ALIVE for v in verdicts.values()),
            )
        return set(self._dead), set(self._alive)


def _liveness(nodes: dict[str, NodeRecord], node: str) -> str | None:
    """The liveness address ``node``'s agent registered, if any."""
    registration = nodes.get(node)
    return registration.liveness if registration is not None else None


def probe_all(addresses: dict[str, str]) -> dict[str, Liveness]:
    """Probe each node's liveness address at once (not one after the other); verdict by node.

    One probe waits up to its timeout for an agent that does not answer; a
    rack gone at once would cost a tick that many timeouts in a row.
    """
    return {node: verdict for node, (verdict, _) in probe_answers(addresses).items()}


def probe_answers(addresses: dict[str, str]) -> dict[str, tuple[Liveness, dict[str, Any]]]:
    """:func:`probe_all` with each agent's answer beside its verdict."""
    if len(addresses) <= 1:
        return {node: probe(address) for node, address in addresses.items()}
    with ThreadPoolExecutor(min(PROBE_THREADS, len(addresses))) as pool:
        answers = pool.map(probe, addresses.values())
        return dict(zip(addresses, answers, strict=True))


def _agent_beats(answer: dict[str, Any]) -> dict[str, float]:
    """The ``beats`` of an agent's liveness answer (worker id -> wall-clock seconds)."""
    beats = answer.get("beats")
    if not isinstance(beats, dict):
        return {}
    numbers = {str(w): t for w, t in beats.items() if isinstance(t, int | float)}
    return {w: float(t) for w, t in numbers.items() if math.isfinite(t)}


def with_newer_beats(
    progress: dict[str, ProgressRecord], beats: dict[str, float]
) -> dict[str, ProgressRecord]:
    """``progress`` with a worker's beat moved on where its agent received a newer one
    than etcd holds (a copy: the records read are kept unchanged, for reuse)."""
    newer = {
        w: replace(p, beat=beat)
        for w, beat in beats.items()
        if (p := progress.get(w)) is not None and beat > p.beat
    }
    return {**progress, **newer} if newer else progress
