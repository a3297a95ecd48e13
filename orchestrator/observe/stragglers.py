"""Stragglers said: events, the job's status and metrics from the controller's judgement.

Runs in the controller, once per tick after the observer.  The judgement is
pure (:mod:`orchestrator.controller.stragglers`); this keeps the previous
window's heartbeats, closes a window every heartbeat interval, and says what
changed: a ``Straggler`` event with the evidence when a node is called slow,
a ``StragglerCleared`` event when it is back under the threshold, the node
and its slowdown in ``JobStatus.stragglers`` (``ringmaster status`` marks it),
and each node's compute time per step and slowdown as metrics.  With
``fault_tolerance.stragglers.action: off`` the workers do not time their
steps, so there is nothing to judge or export.
"""

from __future__ import annotations

import logging
import time

from orchestrator import events
from orchestrator.controller.stragglers import StragglerWatch, node_timings
from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.metrics import JobMetrics
from orchestrator.records import JobStatus, Plan, ProgressRecord, Telemetry
from orchestrator.spec import FaultToleranceSpec, StragglerAction

__all__ = ["StragglerReporter"]

log = logging.getLogger("ringmaster.controller")


class StragglerReporter:
    """Windows of the workers' step timings, judged and said (see the module docstring).

    Args:
        client / job: where events go.
        spec: the job's ``fault_tolerance`` (its stragglers and heartbeat interval).
        metrics: where the per-node gauges go (None: none).
    """

    def __init__(
        self, client: EtcdClient, job: str, spec: FaultToleranceSpec, metrics: JobMetrics | None
    ) -> None:
        self.client, self.job, self.metrics = client, job, metrics
        self.action = spec.stragglers.action
        self.window_s = spec.heartbeat_interval.total_seconds()
        self.watch = StragglerWatch(spec.stragglers)
        self._before: dict[str, Telemetry] = {}
        self._generation = 0
        self._window_at: float | None = None

    def observe(
        self, status: JobStatus, plan: Plan | None, progress: dict[str, ProgressRecord]
    ) -> None:
        now = time.monotonic()
        if plan is None or status.phase.terminal:
            return
        if plan.generation != self._generation:  # the judgement starts over with the group
            self._generation = plan.generation
            members = {m.node for m in plan.members}
            self.watch.forget((set(self.watch.flagged) | set(self.watch.slowdowns)) - members)
            self._before, self._window_at = {}, None
        if self._window_at is not None and now - self._window_at < self.window_s:
            return
        before, self._before = self._before, {w: p.telemetry for w, p in progress.items()}
        self._window_at = now
        timings = node_timings(before, progress, plan) if before else None
        if not timings:
            return
        judged = self.action is not StragglerAction.OFF
        called, cleared = self.watch.judge(timings) if judged else ([], [])
        if self.metrics is not None:
            for node, t in timings.items():
                self.metrics.node_timing(self.job, node, t.compute_s,
                                         self.watch.slowdowns.get(node))  # fmt: skip
        for s in called:
            message = f"{s.describe()}; reported only (fault_tolerance.stragglers.action: report)"
            log.warning("[%s] straggler: %s", self.job, message)
            events.emit(self.client, self.job, "Straggler", message, node=s.node,
                        slowdown=round(s.slowdown, 3))  # fmt: skip
        for node in cleared:
            message = f"{node} steps at its peers' pace again"
            log.info("[%s] %s", self.job, message)
            events.emit(self.client, self.job, "StragglerCleared", message, node=node)
        status.stragglers = {n: round(s.slowdown, 2) for n, s in self.watch.flagged.items()}
