"""A node's break reports in one record: the agent writes them for its workers.

When a member dies, every worker of every surviving node reports that its
generation broke (:meth:`agents.runtime.generation.Generations.report`): 7,992 puts
in the same second at 1,000 nodes x 8 workers, each a key the controller
then reads and decodes.  Relayed, a worker sends its
:class:`~orchestrator.state.records.BreakReport` to its node agent over the
progress socket (:class:`agents.channels.progress.RelayLink`), and the agent
writes one :class:`~orchestrator.state.records.NodeBreakReports` per node and
generation at :func:`orchestrator.state.keys.node_reports`: as soon as every one
of its workers reported, or :data:`GATHER_S` after the first (a worker that
reports later is added by another write).  The worker's report is answered
once it is in etcd; a worker whose agent does not answer writes its own.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys, records
from orchestrator.state.records import BreakReport, NodeBreakReports

#: After a worker's report, how long the agent waits for its other workers' before writing.
GATHER_S = 0.05
#: Generations whose reports are kept after they were written (a late report adds to them).
KEEP_GENERATIONS = 4


def write_node_reports(
    client: EtcdClient, job: str, generation: int, node: str, reports: dict[str, BreakReport]
) -> int:
    """Write ``node``'s workers' ``reports`` of ``generation`` as one record; the revision.

    Raises:
        EtcdError: etcd did not take it.
    """
    record = NodeBreakReports(time.time(), dict(reports))
    return records.write(client, keys.node_reports(job, generation, node), record)


@dataclass
class _Generation:
    #: monotonic time of the first report
    first: float
    reports: dict[str, BreakReport] = field(default_factory=dict)
    #: reports came since the last write
    dirty: bool = True


class NodeReports:
    """The reports of one node's workers, by generation, and when to write them.

    Thread-safe: :meth:`offer` is called as reports arrive, :meth:`write_due`
    by the writer (the relay's writer thread; the benchmark's simulated agent).

    Args:
        job: the job.
        node: this node.
        slots: how many workers the node runs (all reported: write at once).
    """

    def __init__(self, job: str, node: str, slots: int) -> None:
        self.job = job
        self.node = node
        self.slots = slots
        self._lock = threading.Lock()
        self._generations: dict[int, _Generation] = {}
        #: records written so far (the benchmark reads it)
        self.writes = 0

    def offer(self, generation: int, worker: str, report: BreakReport) -> None:
        """Keep ``worker``'s report that ``generation`` broke."""
        with self._lock:
            g = self._generations.get(generation)
            if g is None:
                g = self._generations[generation] = _Generation(time.monotonic())
                for old in sorted(self._generations)[:-KEEP_GENERATIONS]:
                    del self._generations[old]
            g.reports[worker] = report
            g.dirty = True

    def due_at(self) -> float | None:
        """Monotonic time the next write is due; None when every report is written."""
        with self._lock:
            due = [self._due(g) for g in self._generations.values() if g.dirty]
        return min(due) if due else None

    def _due(self, g: _Generation) -> float:
        return -math.inf if len(g.reports) >= self.slots else g.first + GATHER_S

    def write_due(self, client: EtcdClient) -> list[int]:
        """Write every generation whose record is due; returns those generations.

        Raises:
            EtcdError: etcd did not take one (it stays due; the ones before it are written).
        """
        now = time.monotonic()
        with self._lock:
            due = {
                n: dict(g.reports)
                for n, g in self._generations.items()
                if g.dirty and self._due(g) <= now
            }
            for n in due:
                self._generations[n].dirty = False
        written: list[int] = []
        try:
            for n, reports in sorted(due.items()):
                write_node_reports(client, self.job, n, self.node, reports)
                written.append(n)
                self.writes += 1
        finally:
            with self._lock:
                for n in set(due) - set(written):
                    if (g := self._generations.get(n)) is not None:
                        g.dirty = True
        return written
