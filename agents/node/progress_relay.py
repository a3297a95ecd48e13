"""A node's progress in one record: the agent relays its workers' heartbeats to etcd.

Each worker's heartbeat (:mod:`agents.runtime.heartbeat`) used to put its own
:class:`~orchestrator.state.records.ProgressRecord` up to five times a second:
16,000 puts/s at 1,000 nodes x 8 workers.  Now a worker sends its record to
its node agent over a local datagram socket (the agent starts the workers and
names the socket in :data:`~agents.channels.progress.ENV_PROGRESS_SOCKET`), and the agent writes one
:class:`~orchestrator.state.records.NodeProgressRecord` at
:func:`orchestrator.state.keys.node_progress` holding all of them:

* at once (no closer than :data:`MIN_WRITE_GAP_S` to the last write) when
  something the controller acts on changed (:func:`_acted_on`: a new worker
  or process, a generation joined, the first step of a generation, a pause,
  the recovery and checkpoint timings);
* otherwise every :func:`steady_period` (at most :data:`STEADY_WRITE_S`), so
  that the beat times the controller judges hangs and warm spares by stay
  fresh.

A worker's beat time is its own (the agent never refreshes it): a frozen
worker stops sending and its time goes stale in the node's record.

Every reply of the agent says how long etcd has been away for it
(``EtcdClient.unreachable_for``): a worker no longer calls etcd at every beat,
so when its agent sees etcd away for
:data:`~agents.channels.progress.AWAY_CHECK_S` the worker makes a call of its
own (:class:`~agents.channels.progress.RelayLink` and
:mod:`agents.runtime.heartbeat`), and that call is what tells the worker's
runtime to pause, as its heartbeat's put did.

The same socket carries a worker's report that its generation broke
(:meth:`~agents.channels.progress.RelayLink.report`); the agent writes its
workers' reports as one record (:mod:`agents.node.break_reports`) and answers
once it is written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import replace
from typing import Any

from agents.channels.progress import MAX_MESSAGE
from agents.node.break_reports import NodeReports
from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys
from orchestrator.state.api import RecordError
from orchestrator.state.records import BreakReport, NodeProgressRecord, ProgressRecord

log = logging.getLogger("ringmaster.agent")

#: Longest time between two writes of a node's progress in steady state.
STEADY_WRITE_S = 1.0
#: Shortest time between two writes: a change the controller acts on waits for it.
MIN_WRITE_GAP_S = 0.2
#: How long the receiver waits before it looks at the stop flag (close() also wakes it).
RECEIVE_TIMEOUT_S: float | None = 0.5


def steady_period(heartbeat_interval: float) -> float:
    """Time between two steady-state writes: at most half a heartbeat interval.

    A worker beats at least every interval and the controller calls a beat
    stale after three; relayed, a beat may wait one more period before it is
    written, so the period is kept well inside that margin.
    """
    return max(MIN_WRITE_GAP_S, min(STEADY_WRITE_S, heartbeat_interval / 2))


def _acted_on(p: ProgressRecord) -> tuple[Any, ...]:
    """What of a worker's progress the controller acts on at once (not beat times, not totals)."""
    t = replace(p.telemetry, wire_bytes=0, dense_bytes=0)
    return (p.pid, p.generation, p.rank, p.world_size, p.paused, p.recoveries, t)


class NodeProgress:
    """The latest progress of each of a node's workers, and when to write it.

    Thread-safe: :meth:`offer` is called as records arrive, :meth:`write` by
    whoever writes (the relay's writer thread; the benchmark's simulated agent).

    Args:
        job: the job.
        node: this node.
        heartbeat_interval: the job's ``fault_tolerance.heartbeat_interval``, in seconds.
    """

    def __init__(self, job: str, node: str, heartbeat_interval: float) -> None:
        self.key = keys.node_progress(job, node)
        self.period = steady_period(heartbeat_interval)
        self._lock = threading.Lock()
        self._workers: dict[str, ProgressRecord] = {}
        self._written: dict[str, tuple[Any, ...]] = {}
        self._dirty = False
        self._urgent = False
        self._last_write = -math.inf
        #: writes so far, and the size of the last one (the benchmark reads them)
        self.writes = 0
        self.last_bytes = 0

    def offer(self, worker: str, record: ProgressRecord, soon: bool = False) -> bool:
        """Keep ``record`` as ``worker``'s latest; True when it should be written soon.

        Args:
            soon: write it soon whatever changed (a worker waits for the write).
        """
        with self._lock:
            self._workers[worker] = record
            self._dirty = True
            if soon or self._written.get(worker) != _acted_on(record):
                self._urgent = True
            return self._urgent

    def beats(self) -> dict[str, float]:
        """Each worker's latest beat as received here (what the agent's liveness port
        tells the controller: a beat stale in etcd may only be waiting for a write)."""
        with self._lock:
            return {w: p.beat for w, p in self._workers.items()}

    def due_at(self) -> float | None:
        """Monotonic time the next write is due; None when nothing changed since the last."""
        with self._lock:
            if not self._dirty:
                return None
            return self._last_write + (MIN_WRITE_GAP_S if self._urgent else self.period)

    def write(self, client: EtcdClient) -> int:
        """Write the node's record now; returns the revision.

        Raises:
            EtcdError: etcd did not take it (what changed is written next time).
        """
        with self._lock:
            workers = dict(self._workers)
            self._dirty = self._urgent = False
            self._last_write = time.monotonic()
        text = NodeProgressRecord(time.time(), workers).encode()
        try:
            revision = client.put(self.key, text)
        except BaseException:
            with self._lock:
                self._dirty = self._urgent = True
            raise
        with self._lock:
            for w, p in workers.items():
                self._written[w] = _acted_on(p)
            # a record that came during the write is judged against what was written
            self._urgent = self._dirty and any(
                self._written.get(w) != _acted_on(p) for w, p in self._workers.items()
            )
            self.writes += 1
            self.last_bytes = len(text)
        return revision


class ProgressRelay:
    """The agent's side: receives its workers' records, writes the node's record.

    Two daemon threads: one answers the workers (at once, with how long etcd
    has been away for the agent; a synchronous beat is answered after the
    write that carries it, a break report after the write of the node's
    reports), one writes when :meth:`NodeProgress.due_at` or
    :meth:`NodeReports.due_at` says.

    Args:
        client: the agent's etcd client.
        progress: the node's records.
        reports: the node's break reports; None: a worker's report is answered
            as not written, and the worker writes its own.
    """

    def __init__(
        self, client: EtcdClient, progress: NodeProgress, reports: NodeReports | None = None
    ) -> None:
        self.client = client
        self.progress = progress
        self.reports = reports
        name = f"\0ringmaster-progress-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(name)
        self._sock.settimeout(RECEIVE_TIMEOUT_S)
        #: what a worker's environment names the socket by
        self.address = "@" + name[1:]
        self._stop = threading.Event()
        self._wake = threading.Condition()
        #: synchronous beats waiting for the next write: (reply address, seq)
        self._waiting: list[tuple[Any, int]] = []
        #: break reports waiting for their generation's write: (reply address, seq, generation)
        self._reported: list[tuple[Any, int, int]] = []
        self._threads = [
            threading.Thread(target=self._receive, name="progress-relay", daemon=True),
            threading.Thread(target=self._write_loop, name="progress-writer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data, sender = self._sock.recvfrom(MAX_MESSAGE)
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if self._stop.is_set():  # close()'s wake-up, or a last beat: written by close()
                return
            try:
                msg = json.loads(data)
                worker = keys.segment(str(msg["worker"]), "worker id")
                seq = int(msg["seq"])
                if msg.get("kind") == "report":
                    self._take_report(sender, seq, worker, msg)
                    continue
                record = ProgressRecord.from_dict(msg["record"], f"progress of {worker}")
                sync = bool(msg.get("sync"))
            except (ValueError, KeyError, TypeError, RecordError) as e:
                log.warning("progress message dropped (not a worker's record): %s", e)
                continue
            urgent = self.progress.offer(worker, record, soon=sync)
            if sync:
                with self._wake:
                    self._waiting.append((sender, seq))
                    self._wake.notify()
                continue
            self._reply(sender, seq)
            if urgent:
                with self._wake:
                    self._wake.notify()

    def _take_report(self, sender: Any, seq: int, worker: str, msg: dict[str, Any]) -> None:
        """Keep a worker's break report for the node's next write (without
        :class:`NodeReports`: tell the worker at once to write its own)."""
        if self.reports is None:
            self._reply(sender, seq, written=False)
            return
        generation = int(msg["generation"])
        report = BreakReport.from_dict(msg["report"], f"break report of {worker}")
        self.reports.offer(generation, worker, report)
        with self._wake:
            self._reported.append((sender, seq, generation))
            self._wake.notify()

    def _reply(self, to: Any, seq: int, written: bool = False) -> None:
        away = self.client.unreachable_for()
        with contextlib.suppress(OSError):  # the worker is gone
            reply = {"seq": seq, "away": away, "written": written}
            self._sock.sendto(json.dumps(reply).encode(), to)

    def _due(self) -> float | None:
        due = [d for d in (self.progress.due_at(), self._reports_due()) if d is not None]
        return min(due) if due else None

    def _reports_due(self) -> float | None:
        return self.reports.due_at() if self.reports is not None else None

    def _write_loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            with self._wake:
                due = self._due()
                wait = 0.5 if due is None else due - time.monotonic()
                if wait > 0:
                    self._wake.wait(min(wait, 0.5))
                    continue
            try:
                self._write_reports()
                self._write_progress()
            except EtcdError as e:
                if not failing:
                    log.warning("node progress or reports not written (will retry): %s", e)
                failing = True
                self._stop.wait(MIN_WRITE_GAP_S)
                continue
            if failing:
                log.info("node progress and reports written again")
            failing = False

    def _write_reports(self) -> None:
        """Write the break reports that are due; answer the workers whose report was written."""
        written = set(self.reports.write_due(self.client)) if self.reports is not None else set()
        if not written:
            return
        with self._wake:
            answered = [r for r in self._reported if r[2] in written]
            self._reported = [r for r in self._reported if r[2] not in written]
        for to, seq, _ in answered:
            self._reply(to, seq, written=True)

    def _write_progress(self) -> None:
        """Write the node's progress if due; answer the synchronous beats it carried."""
        due = self.progress.due_at()
        if due is None or due > time.monotonic():
            return
        with self._wake:
            waiting, self._waiting = self._waiting, []
        try:
            self.progress.write(self.client)
        except BaseException:
            with self._wake:
                self._waiting = waiting + self._waiting
            raise
        for to, seq in waiting:
            self._reply(to, seq, written=True)

    def close(self) -> None:
        """Stop relaying; what arrived and was not written yet is written once more."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        with contextlib.suppress(OSError):  # wakes the receiver at once (not its 0.5 s timeout)
            self._sock.sendto(b"", "\0" + self.address[1:])
        for t in self._threads:
            t.join(timeout=2)
        self._sock.close()
        if self.progress.due_at() is not None:
            with contextlib.suppress(EtcdError):
                self.progress.write(self.client)
        if self.reports is not None and self.reports.due_at() is not None:
            with contextlib.suppress(EtcdError):
                self.reports.write_due(self.client)
