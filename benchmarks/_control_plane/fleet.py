"""A slice of the simulated fleet: N node agents x W workers that train nothing.

Run as ``python -m benchmarks._control_plane.fleet`` by ``benchmarks/control_plane.py``,
one process per slice.  Every simulated node does against etcd what a node
agent and its workers do, through the project's own code:

* the agent registers a :class:`~orchestrator.state.records.NodeRecord` at
  :func:`~orchestrator.state.keys.job_node` under a lease of ``RINGMASTER_NODE_TTL``
  (:meth:`EtcdClient.lease <orchestrator.etcd.client.EtcdClient.lease>`),
  refreshed every third of it with :meth:`Lease.refresh
  <orchestrator.etcd.kv.Lease.refresh>` (what ``Lease.keep_alive`` does), and
  serves a :class:`~orchestrator.ports.liveness.LivenessServer`;
* each worker beats at the heartbeat's rate (:mod:`agents.runtime.heartbeat`): at
  every step boundary but no closer together than ``MIN_BEAT_GAP``, and at
  least every ``heartbeat_interval`` (a spare beats every interval); its
  :class:`~orchestrator.state.records.ProgressRecord` goes to its agent's
  :class:`agents.node.progress_relay.NodeProgress`, which the agent writes as one
  :class:`~orchestrator.state.records.NodeProgressRecord` when it is due (a change
  the controller acts on: at once, no closer than ``MIN_WRITE_GAP_S``;
  otherwise every steady period), as :class:`agents.node.progress_relay.ProgressRelay`
  does (the local socket between a worker and its agent is not simulated);
* each worker's output goes through an :class:`agents.node.log_shipper.LogShipper`
  at ``log_lines_per_s`` (its ``write_lines``: to the node's files, not to
  etcd; a temporary directory per slice);
* the plan is followed by :class:`agents.runtime.plan_watch.PlanWatcher` (a watch on
  the plan and one on the control key): ``watchers_per_node`` of them per
  node, 1 by default: the agent's, which passes the plan on to its workers
  (:mod:`agents.channels.plan_feed`; the local socket is not simulated);
* when a peer crashes, every worker of the surviving members reports its
  :class:`~orchestrator.state.records.BreakReport` to its agent's
  :class:`agents.node.break_reports.NodeReports`, which the agent writes as one
  :class:`~orchestrator.state.records.NodeBreakReports` (all its workers reported
  at once, so at once), and stops stepping until a newer plan arrives.

What is not real: the step clock (a step every ``step_time``), the re-forming
of the process group (``REFORM_S``), the pids, and the threads: every timed
call of the slice runs on a few :class:`~benchmarks._control_plane.lanes.Lanes`
instead of a thread per worker.

Protocol: one JSON object per line.  Commands come on stdin (``{"cmd": ...}``),
each answered by one line on stdout; logging goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.etcd.grpc_env import apply_grpc_environment

apply_grpc_environment()  # before gRPC is imported, as the CLI does

from agents.node import log_files  # noqa: E402
from agents.node.break_reports import NodeReports  # noqa: E402
from agents.node.log_shipper import LogShipper  # noqa: E402
from agents.node.progress_relay import NodeProgress  # noqa: E402
from agents.runtime.heartbeat import MIN_BEAT_GAP  # noqa: E402
from agents.runtime.plan_watch import PlanWatcher  # noqa: E402
from benchmarks._control_plane.lanes import Lanes  # noqa: E402
from orchestrator.api import EtcdError  # noqa: E402
from orchestrator.etcd.client import EtcdClient, connect  # noqa: E402
from orchestrator.etcd.diagnosis import EtcdLeaseNotFoundError  # noqa: E402
from orchestrator.etcd.kv import Lease  # noqa: E402
from orchestrator.etcd.options import EtcdOptions  # noqa: E402
from orchestrator.ports.liveness import LivenessServer  # noqa: E402
from orchestrator.state import keys, records  # noqa: E402
from orchestrator.state.records import (  # noqa: E402
    BreakReport,
    NodeRecord,
    Plan,
    ProgressRecord,
    Telemetry,
)

log = logging.getLogger("ringmaster.bench.fleet")

#: Simulated time from seeing a new plan to the first step in it (group formed, state restored).
REFORM_S = 0.5
#: How often the plan watchers are looked at: while a failure is timed, and otherwise.
POLL_ARMED_S = 0.005
POLL_IDLE_S = 0.1
#: A line of simulated worker output (a typical training log line, ~100 characters).
LOG_LINE = "step {step} loss {loss:.4f} lr 3.0e-04 grad_norm 0.8123 tokens/s 182344.1 mem 61.2GiB"
#: How often a simulated worker's output lines are handed to its shipper.
LOG_EVERY_S = 0.5
#: Simulated model traffic per step, for the telemetry's byte counters.
WIRE_BYTES_PER_STEP = 4_000_000
#: Threads that refresh the slice's leases.
LEASE_LANES = 16
#: Beats whose encoded size is measured (one in this many).
SIZE_SAMPLE_EVERY = 25


@dataclass
class FleetConfig:
    """What one slice simulates (from the command line)."""

    endpoints: list[str]
    job: str
    first: int
    count: int
    workers: int
    step_time: float
    heartbeat_interval: float
    node_ttl: int
    log_lines_per_s: float
    lanes: int
    clients: int
    watchers_per_node: int
    #: ``plan``: a PlanWatcher per watcher; ``raw``: a bare watch of the plan key per watcher
    watch: str = "plan"

    @property
    def node_names(self) -> list[str]:
        return [node_name(i) for i in range(self.first, self.first + self.count)]


def node_name(index: int) -> str:
    return f"n{index:05d}"


def node_labels(index: int) -> dict[str, str]:
    """Topology labels: 16 nodes a rack, 16 racks a zone."""
    return {"zone": f"z{index // 256}", "rack": f"r{index // 16}", "host": node_name(index)}


@dataclass(frozen=True)
class Role:
    """What a node's workers are doing; replaced whole when it changes (read lock-free)."""

    generation: int = 0
    member: bool = False
    rank_base: int = -1
    world_size: int = 0
    #: monotonic time steps move again (after a new plan: the group re-formed)
    resume_at: float = 0.0
    #: the step they stand at when ``resume_at`` comes
    step_base: int = 0
    #: a peer crashed: no steps until a newer plan
    broken: bool = False
    #: wall-clock time the group of ``generation`` formed (telemetry)
    formed_wall: float | None = None
    recoveries: int = 0


class Counters:
    """Thread-safe counts and maxima of what the slice wrote."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.maxima: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def take(self, reset: bool) -> tuple[dict[str, int], dict[str, int]]:
        """The counts and maxima so far; with ``reset``, counting starts again."""
        with self._lock:
            out = dict(self.counts), dict(self.maxima)
            if reset:
                self.counts, self.maxima = {}, {}
        return out

    def size(self, name: str, size: int) -> None:
        with self._lock:
            if size > self.maxima.get(name, 0):
                self.maxima[name] = size


@dataclass
class SimWorker:
    node: SimNode
    local_rank: int
    pid: int
    key: str
    incarnation: int
    beats: int = 0
    last_step: int = -1
    step_wall: float = field(default_factory=time.time)


class SimNode:
    """One simulated node agent and its workers."""

    def __init__(self, fleet: Fleet, index: int) -> None:
        self.fleet = fleet
        self.index = index
        self.name = node_name(index)
        self.labels = node_labels(index)
        self.client = fleet.clients[index % len(fleet.clients)]
        self.lane = index % len(fleet.lanes.lanes)
        self.incarnation = 0
        self.alive = False
        self.role = Role()
        #: the newest plan this node acted on
        self.plan_generation = 0
        self.lease: Lease | None = None
        self.liveness: LivenessServer | None = None
        self.watchers: list[PlanWatcher] = []
        #: raw mode: the ids of this node's watch callbacks
        self.watch_ids: list[int] = []
        #: per watcher: (the plan's mod_revision, wall time) each time it saw a newer plan
        self.seen: list[list[tuple[int, float]]] = []
        self.workers: list[SimWorker] = []
        self.shippers: list[LogShipper] = []
        self.progress = NodeProgress(fleet.cfg.job, self.name, fleet.cfg.heartbeat_interval)
        self.reports = NodeReports(fleet.cfg.job, self.name, fleet.cfg.workers)
        #: a write of the node's progress is scheduled for a change the controller acts on
        self.flush_pending = False

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Register (a new incarnation: fresh lease, pids, watchers) and start beating."""
        cfg = self.fleet.cfg
        self.incarnation += 1
        self.role = Role()
        self.plan_generation = 0
        self.progress = NodeProgress(cfg.job, self.name, cfg.heartbeat_interval)
        self.reports = NodeReports(cfg.job, self.name, cfg.workers)
        self.flush_pending = False
        self.liveness = LivenessServer("127.0.0.1", self._liveness_status)
        self.seen = [[] for _ in range(cfg.watchers_per_node)]
        if cfg.watch == "plan":
            self.watchers = [PlanWatcher(self.client, cfg.job) for _ in self.seen]
        else:
            self.watch_ids = [self._watch_plan(i) for i in range(len(self.seen))]
        base = 100_000 + self.index * 1000 + self.incarnation * 10
        self.workers = [
            SimWorker(
                self,
                lr,
                base + lr,
                keys.job_progress(cfg.job) + keys.worker_id(self.name, lr),
                self.incarnation,
            )
            for lr in range(cfg.workers)
        ]
        log_dir = log_files.node_dir(self.fleet.log_dir, cfg.job, self.name)
        self.shippers = [
            LogShipper(self.client, cfg.job, self.name, lr, io.BytesIO(), log_dir=log_dir)
            for lr in range(cfg.workers)
        ]
        self._register_under_new_lease()
        assert self.lease is not None
        self.alive = True
        now = time.monotonic()
        lanes = self.fleet.lanes
        self.fleet.lease_lanes.add(now + self.lease.ttl / 3.0, LeaseJob(self, self.incarnation))
        for w in self.workers:
            # a worker beats once as it starts (the runtime's init), then at its rate
            lanes.add(now, BeatJob(w), self.lane)
        first = now + random.uniform(0, self.progress.period)
        lanes.add(first, NodeProgressJob(self, self.incarnation), self.lane)
        if cfg.log_lines_per_s > 0:
            for lr, shipper in enumerate(self.shippers):
                first = now + random.uniform(0, LOG_EVERY_S)
                lanes.add(first, LogJob(self, lr, shipper, self.incarnation), self.lane)

    def _register_under_new_lease(self, attempts: int = 5) -> None:
        """Grant the node's lease and register under it; on a machine so busy that the
        lease expired before the write, grant another (as an agent would)."""
        for attempt in range(attempts):
            self.lease = self.client.lease(self.fleet.cfg.node_ttl)
            try:
                self.register()
                return
            except EtcdLeaseNotFoundError:
                if attempt == attempts - 1:
                    raise
                self.fleet.counters.add("leases_lost")
                log.warning("lease of %s expired before it registered; again", self.name)

    def register(self) -> None:
        assert self.lease is not None
        record = NodeRecord(
            host=self.name,
            address="127.0.0.1",
            slots=self.fleet.cfg.workers,
            pid=100_000 + self.index * 1000 + self.incarnation * 10 + 9,
            worker_pids=[w.pid for w in self.workers],
            started=time.time(),
            labels=dict(self.labels),
            liveness=self.liveness.address if self.liveness else None,
            recovery="in_process",
        )
        records.write(self.client, keys.job_node(self.fleet.cfg.job, self.name), record, self.lease)
        self.fleet.counters.add("node_writes")

    def _watch_plan(self, index: int) -> int:
        """Raw mode: a bare watch of the plan key, as the one a PlanWatcher opens."""
        key = keys.job_plan(self.fleet.cfg.job)
        callback = functools.partial(self._arrived, index)

        def add(c: Any) -> int:
            return int(c.add_watch_callback(key, callback))

        return self.client.transport.call(add)

    def _arrived(self, index: int, response: Any) -> None:
        """Raw mode: a watch of the plan key delivered ``response`` (or an error)."""
        if isinstance(response, Exception):
            self.fleet.counters.add("watch_errors")
            return
        at = time.time()
        for ev in response.events:
            self.seen[index].append((int(ev.mod_revision), at))

    def _liveness_status(self) -> dict[str, Any]:
        return {"node": self.name, "workers": {str(w.local_rank): True for w in self.workers}}

    def stop(self, revoke: bool) -> float:
        """Stop being this node (crash or leave); returns the wall time it stopped."""
        at = time.time()
        self.alive = False
        if self.liveness is not None:
            self.liveness.close()  # connections are refused from now on
        for w in self.watchers:
            w.stop()
        for watch_id in self.watch_ids:
            with contextlib.suppress(Exception):
                self.client.transport.raw.cancel_watch(watch_id)
        self.watch_ids = []
        if revoke and self.lease is not None:
            self.lease.revoke()
        return at

    # -- the step clock ----------------------------------------------------------------

    def step(self, mono: float) -> int:
        role = self.role
        if not role.member or role.broken or mono < role.resume_at:
            return role.step_base
        return role.step_base + int((mono - role.resume_at) / self.fleet.cfg.step_time)

    def next_boundary(self, mono: float) -> float:
        """Monotonic time of this node's next step boundary (inf when it does not step)."""
        role = self.role
        if not role.member or role.broken:
            return math.inf
        if mono < role.resume_at:
            return role.resume_at
        done = int((mono - role.resume_at) / self.fleet.cfg.step_time)
        return role.resume_at + (done + 1) * self.fleet.cfg.step_time

    def take_plan(self, plan: Plan, mono: float) -> None:
        """A newer plan was seen: members re-form and step on, the others wait as spares."""
        member = plan.member(self.name)
        old = self.role
        if member is None:
            if old.member:  # left out of the plan: wait as a spare, holding the step
                self.role = dataclasses.replace(old, member=False, step_base=self.step(mono))
            return
        step = self.step(mono) if old.member else self.fleet.highest_step(mono)
        self.role = Role(
            generation=plan.generation,
            member=True,
            rank_base=member.rank_base,
            world_size=plan.world_size,
            resume_at=mono + REFORM_S,
            step_base=step,
            formed_wall=time.time() + REFORM_S,
            recoveries=old.recoveries + (1 if old.generation > 0 else 0),
        )
        for w in self.workers:  # a new generation pokes the heartbeat
            self.fleet.lanes.add(mono + REFORM_S, PokeJob(w), self.lane)

    def broke(self, generation: int, reason: str) -> int:
        """A peer of ``generation`` crashed: freeze, and let every worker report it."""
        role = self.role
        if not self.alive or not role.member or role.generation != generation:
            return 0
        mono = time.monotonic()
        self.role = dataclasses.replace(role, broken=True, step_base=self.step(mono))
        self.fleet.lanes.add(mono, ReportJob(self, generation, reason), self.lane)
        return len(self.workers)


# ------------------------------------------------------------------------------ jobs


class BeatJob:
    """A worker's heartbeat (:class:`agents.runtime.heartbeat.Heartbeat`'s rate)."""

    def __init__(self, worker: SimWorker) -> None:
        self.w = worker

    def __repr__(self) -> str:
        return f"beat {self.w.key}"

    def run(self, now: float) -> float | None:
        w = self.w
        node = w.node
        if not node.alive or node.incarnation != w.incarnation:
            return None
        beat(w, now)
        cfg = node.fleet.cfg
        hb = cfg.heartbeat_interval
        boundary = node.next_boundary(now)
        if boundary < math.inf and cfg.step_time < hb:
            # the step boundary pokes the heartbeat; pokes closer than the gap share a beat
            return min(max(boundary + 0.001, now + MIN_BEAT_GAP), now + hb)
        return now + hb


class PokeJob:
    """One extra beat (a new generation was joined)."""

    def __init__(self, worker: SimWorker) -> None:
        self.w = worker

    def run(self, now: float) -> float | None:
        node = self.w.node
        if node.alive and node.incarnation == self.w.incarnation:
            beat(self.w, now)
        return None


def beat(w: SimWorker, now: float) -> None:
    node = w.node
    fleet = node.fleet
    role = node.role
    step = node.step(now)
    wall = time.time()
    if step != w.last_step:
        w.last_step, w.step_wall = step, wall
    formed = role.formed_wall if role.member else None
    record = ProgressRecord(
        step=step,
        generation=role.generation,
        rank=role.rank_base + w.local_rank if role.member else -1,
        world_size=role.world_size,
        pid=w.pid,
        beat=wall,
        step_time=w.step_wall,
        recoveries=role.recoveries,
        last_recovery_s=0.62 if role.recoveries else None,
        metrics={"loss": 2.5 / (1 + step / 1000), "samples": 32.0} if role.member else {},
        telemetry=Telemetry(
            generation=role.generation,
            group_formed_at=formed,
            restored_at=formed,
            restored_step=role.step_base if role.member else None,
            first_step_at=formed + fleet.cfg.step_time if formed is not None else None,
            wire_bytes=step * WIRE_BYTES_PER_STEP,
            dense_bytes=step * WIRE_BYTES_PER_STEP,
        ),
    )
    urgent = node.progress.offer(keys.worker_id(node.name, w.local_rank), record)
    w.beats += 1
    fleet.counters.add("beats")
    if w.beats % SIZE_SAMPLE_EVERY == 1:
        fleet.counters.size("beat", len(record.encode()))
    if urgent and not node.flush_pending:
        node.flush_pending = True
        due = node.progress.due_at()
        fleet.lanes.add(max(now, due or now), FlushJob(node, node.incarnation), node.lane)


def write_progress(node: SimNode) -> None:
    """The agent writes its node's progress record (``ProgressRelay``'s writer)."""
    counters = node.fleet.counters
    try:
        node.progress.write(node.client)
    except EtcdError as e:
        counters.add("put_errors")
        log.debug("progress of %s not written: %s", node.name, e)
        return
    counters.add("node_progress")
    if node.progress.writes % SIZE_SAMPLE_EVERY == 1:
        counters.size("node_progress", node.progress.last_bytes)


class NodeProgressJob:
    """The agent's steady writes of its node's progress (when due: every steady period)."""

    def __init__(self, node: SimNode, incarnation: int) -> None:
        self.node = node
        self.incarnation = incarnation

    def __repr__(self) -> str:
        return f"progress of {self.node.name}"

    def run(self, now: float) -> float | None:
        node = self.node
        if not node.alive or node.incarnation != self.incarnation:
            return None
        due = node.progress.due_at()
        if due is None:
            return now + node.progress.period
        if due > now:
            return due
        write_progress(node)
        return now + node.progress.period


class FlushJob:
    """A write of the node's progress for a change the controller acts on (one at a time)."""

    def __init__(self, node: SimNode, incarnation: int) -> None:
        self.node = node
        self.incarnation = incarnation

    def run(self, now: float) -> float | None:
        node = self.node
        if not node.alive or node.incarnation != self.incarnation:
            return None
        due = node.progress.due_at()
        if due is not None and due > now:
            return due
        node.flush_pending = False
        if due is not None:
            write_progress(node)
        return None


class LeaseJob:
    """A node's lease keep-alive (every third of the TTL, as ``Lease.keep_alive``)."""

    def __init__(self, node: SimNode, incarnation: int) -> None:
        self.node = node
        self.incarnation = incarnation

    def __repr__(self) -> str:
        return f"lease of {self.node.name}"

    def run(self, now: float) -> float | None:
        node = self.node
        if not node.alive or node.incarnation != self.incarnation or node.lease is None:
            return None
        lease = node.lease
        try:
            ttl = lease.refresh()
        except EtcdError as e:
            node.fleet.counters.add("lease_refresh_errors")
            log.warning("lease of %s not refreshed: %s", node.name, e)
            return now + lease.ttl / 3.0
        node.fleet.counters.add("lease_refreshes")
        if ttl <= 0:  # expired under us: register again under a new lease, as the agent does
            node.fleet.counters.add("leases_lost")
            log.warning("lease of %s expired while alive; registering again", node.name)
            node.lease = node.client.lease(node.fleet.cfg.node_ttl)
            node.register()
        return now + lease.ttl / 3.0


class LogJob:
    """A worker's output, handed to its :class:`LogShipper` every ``LOG_EVERY_S``."""

    def __init__(self, node: SimNode, local_rank: int, shipper: LogShipper, incarnation: int):
        self.node = node
        self.local_rank = local_rank
        self.shipper = shipper
        self.incarnation = incarnation
        self.owed = random.random()
        self.last = time.monotonic()

    def __repr__(self) -> str:
        return f"logs of {self.node.name}/{self.local_rank}"

    def run(self, now: float) -> float | None:
        node = self.node
        if not node.alive or node.incarnation != self.incarnation:
            return None
        self.owed += node.fleet.cfg.log_lines_per_s * (now - self.last)
        self.last = now
        count = int(self.owed)
        if count:
            self.owed -= count
            step = node.step(now)
            wall = time.time()
            text = LOG_LINE.format(step=step, loss=2.5 / (1 + step / 1000))
            # no pipe to read: the lines take the reader's own path (files, the tail)
            self.shipper.write_lines([(wall, text)] * count)
            node.fleet.counters.add("log_lines", count)
        return now + LOG_EVERY_S


class ReportJob:
    """A node's workers report that their generation broke; the agent writes them as one."""

    def __init__(self, node: SimNode, generation: int, reason: str) -> None:
        self.node = node
        self.generation = generation
        self.reason = reason

    def run(self, now: float) -> float | None:
        node = self.node
        for w in node.workers:  # what each worker sends its agent (Generations.report)
            report = BreakReport(
                step=node.step(now), reason=self.reason, planned=False, at=time.time()
            )
            node.reports.offer(self.generation, keys.worker_id(node.name, w.local_rank), report)
        try:
            written = node.reports.write_due(node.client)
            node.fleet.counters.add("reports", len(written))
            node.fleet.reported_at.append(time.time())
        except EtcdError as e:
            node.fleet.counters.add("put_errors")
            log.warning("reports of %s failed: %s", node.name, e)
        return None


# ----------------------------------------------------------------------------- fleet


class Fleet:
    """This process's slice of nodes, its lanes and clients, and the plan follower."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.counters = Counters()
        #: the simulated nodes' log directory (what RINGMASTER_LOG_DIR names on a node)
        self.log_dir = Path(tempfile.mkdtemp(prefix="rm-fleet-logs-"))
        options = EtcdOptions(tuple(cfg.endpoints))
        self.clients: list[EtcdClient] = [
            connect(options) for _ in range(max(1, min(cfg.clients, cfg.count)))
        ]
        self.lanes = Lanes(cfg.lanes)
        #: keep-alives have lanes of their own, as an agent has a thread for its lease
        self.lease_lanes = Lanes(LEASE_LANES)
        self.nodes = {
            name: SimNode(self, i)
            for i, name in zip(range(cfg.first, cfg.first + cfg.count), cfg.node_names, strict=True)
        }
        self.armed = False
        #: wall times the nodes' break reports were written, since the last ``break``
        self.reported_at: list[float] = []
        #: raw mode: the slice's one plan watcher, which tells the nodes their roles
        self.plan_watcher: PlanWatcher | None = None
        self.plan_generation = 0
        self._stopped = threading.Event()
        self._follower = threading.Thread(target=self._follow, name="follower", daemon=True)
        self.cpu_at_reset = time.process_time()
        self.wall_at_reset = time.monotonic()

    def start(self) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: n.start(), self.nodes.values()))
        if self.cfg.watch == "raw":
            self.plan_watcher = PlanWatcher(self.clients[0], self.cfg.job)
        self._follower.start()

    def highest_step(self, mono: float) -> int:
        steps = [n.step(mono) for n in self.nodes.values() if n.alive and n.role.member]
        return max(steps, default=0)

    def _follow(self) -> None:
        """Follow the plan: note when each node's watchers saw a newer one, act on it."""
        while not self._stopped.wait(POLL_ARMED_S if self.armed else POLL_IDLE_S):
            if self.plan_watcher is not None:  # raw mode: one watcher decodes for the slice
                plan = _newer(self.plan_watcher, self.plan_generation)
                if plan is not None:
                    self.plan_generation = plan.generation
                    mono = time.monotonic()
                    for node in list(self.nodes.values()):
                        if node.alive:
                            node.take_plan(plan, mono)
                continue
            for node in list(self.nodes.values()):
                if not node.alive:
                    continue
                for i, watcher in enumerate(node.watchers):
                    seen = node.seen[i]
                    generation = watcher.latest_generation()
                    revision = watcher.revision_of(generation)
                    if generation == 0 or (seen and revision <= seen[-1][0]):
                        continue
                    seen.append((revision, time.time()))
                    plan = _newer(watcher, node.plan_generation) if i == 0 else None
                    if plan is not None:
                        node.plan_generation = plan.generation
                        node.take_plan(plan, time.monotonic())

    def collect(self, revision: int, timeout: float) -> dict[str, Any]:
        """When every watcher of every live node saw the plan written at ``revision``.

        Returns:
            ``seen``: node -> the latest of its watchers' first sightings (wall
            seconds); ``missing``: live nodes still without it after ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            seen: dict[str, float] = {}
            missing: list[str] = []
            for node in self.nodes.values():
                if not node.alive:
                    continue
                firsts = [next((t for r, t in s if r >= revision), None) for s in node.seen]
                if any(t is None for t in firsts):
                    missing.append(node.name)
                else:
                    seen[node.name] = max(t for t in firsts if t is not None)
            if not missing or time.monotonic() >= deadline:
                reported = list(self.reported_at)
                return {"seen": seen, "missing": missing, "reported": reported[:1] + reported[-1:]}
            time.sleep(POLL_ARMED_S)

    def stats(self, reset: bool) -> dict[str, Any]:
        late, took = self.lanes.samples(reset)
        late.sort()
        took.sort()
        leases, _ = self.lease_lanes.samples(reset)
        leases.sort()
        cpu, wall = time.process_time(), time.monotonic()
        counts, maxima = self.counters.take(reset)
        out = {
            "counts": counts,
            "maxima": maxima,
            "lane_errors": self.lanes.errors + self.lease_lanes.errors,
            "late_p50_s": _quantile(late, 0.5),
            "late_p99_s": _quantile(late, 0.99),
            "late_max_s": late[-1] if late else 0.0,
            "call_p50_s": _quantile(took, 0.5),
            "call_p99_s": _quantile(took, 0.99),
            "lease_late_max_s": leases[-1] if leases else 0.0,
            "cpu_s": cpu - self.cpu_at_reset,
            "wall_s": wall - self.wall_at_reset,
            "threads": threading.active_count(),
        }
        if reset:
            self.cpu_at_reset, self.wall_at_reset = cpu, wall
        return out

    def stop(self) -> None:
        self._stopped.set()
        self.lanes.stop()
        self.lease_lanes.stop()
        for node in self.nodes.values():
            if node.alive:
                node.stop(revoke=False)
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()
        shutil.rmtree(self.log_dir, ignore_errors=True)


def _newer(watcher: PlanWatcher, generation: int) -> Plan | None:
    """The watcher's plan if it is newer than ``generation`` (no etcd read)."""
    if watcher.latest_generation() <= generation:
        return None
    return watcher.wait_newer(generation, 0)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


# ---------------------------------------------------------------------------- protocol


def serve(fleet: Fleet) -> None:
    """Answer the benchmark's commands until ``stop`` or end of input."""
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        reply: dict[str, Any] = {"cmd": cmd}
        if cmd == "start":
            started = time.monotonic()
            fleet.start()
            reply["setup_s"] = time.monotonic() - started
        elif cmd == "arm":
            fleet.armed = bool(msg["on"])
            fleet.reported_at = []
        elif cmd == "collect":
            reply.update(fleet.collect(int(msg["revision"]), float(msg["within"])))
        elif cmd in ("revoke", "crash"):
            reply["at"] = fleet.nodes[msg["node"]].stop(revoke=cmd == "revoke")
        elif cmd == "break":
            reply["reports"] = sum(
                n.broke(int(msg["generation"]), str(msg["reason"])) for n in fleet.nodes.values()
            )
        elif cmd == "revive":
            fleet.nodes[msg["node"]].start()
        elif cmd == "stats":
            reply.update(fleet.stats(bool(msg.get("reset"))))
        elif cmd == "stop":
            fleet.stop()
            _send(reply)
            return
        else:
            reply["error"] = f"unknown command {cmd!r}"
        _send(reply)


def _send(reply: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="FleetConfig as JSON")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s fleet %(message)s")
    cfg = FleetConfig(**json.loads(args.config))
    fleet = Fleet(cfg)
    try:
        serve(fleet)
    except BaseException:
        log.exception("fleet slice %d..%d failed", cfg.first, cfg.first + cfg.count - 1)
        raise
    finally:
        with contextlib.suppress(Exception):
            fleet.stop()
        os._exit(0)  # daemon threads blocked in gRPC must not hold the exit


if __name__ == "__main__":
    main()
