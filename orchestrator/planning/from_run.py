"""A failure model and recovery costs from what a job recorded in etcd.

Read through the observers' own readers: the job's status (its nodes and
wall time), its :class:`~orchestrator.observe.records.RecoveryRecord` s (each
failure's cause, nodes and phases) and its ``NodeFailed`` events (a spare that
died leaves no recovery).  The failure rate is failures per node-day over the
run's wall time; the recovery costs are the median phases of its recoveries.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

from orchestrator import events, keys, records
from orchestrator.etcd.client import EtcdClient
from orchestrator.jobs import read_status
from orchestrator.observe.records import RecoveryRecord
from orchestrator.planning.api import FailureModel, FailureSource, FaultKind, PlanError
from orchestrator.planning.costs import Measured

__all__ = ["RunFigures", "failure_model_from_run", "measured_from_run", "read_run"]

_KINDS = {"hang": FaultKind.HANG, "preemption": FaultKind.PREEMPTION}


@dataclass
class RunFigures:
    """What one job's records say about its failures.

    Attributes:
        nodes: nodes the job held (training and spare) at its last status.
        wall_s: seconds from its submission to its end (or now).
        failures: failed nodes by kind.
        phases: median seconds of each recovery phase (``detect`` ... ``first_step``).
        recoveries: recoveries recorded.
    """

    job: str
    nodes: int
    wall_s: float
    failures: dict[FaultKind, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    recoveries: int = 0

    @property
    def node_days(self) -> float:
        return self.nodes * self.wall_s / 86400.0


def read_run(client: EtcdClient, job: str, now: float | None = None) -> RunFigures:
    """The failures and recovery phases ``job`` recorded.

    Raises:
        PlanError: no such job, or it has not trained yet.
    """
    status = read_status(client, job)
    if status is None:
        raise PlanError(
            f"--from-run {job}: no job of that name in this etcd (see `ringmaster status` "
            "for the jobs it holds, or pass --etcd for another)"
        )
    start = status.train_started_at or status.submitted_at
    end = status.finished_at or (time.time() if now is None else now)
    nodes = len(status.active_nodes) + len(status.spare_nodes) + len(status.failed_nodes)
    if not start or end <= start or nodes == 0:
        raise PlanError(
            f"--from-run {job}: the job has not trained yet (no first step recorded); "
            "plan from a preset until it has run"
        )
    found = records.read_all(client, keys.job_recoveries(job), RecoveryRecord).values()
    recoveries = [r for r in found if r.run == status.run]
    failures: dict[FaultKind, int] = {}
    covered: set[str] = set()
    for r in recoveries:
        kind = _KINDS.get(r.cause, FaultKind.CRASH)
        failures[kind] = failures.get(kind, 0) + max(1, len(r.nodes))
        covered.update(r.nodes)
    for ev in events.list_events(client, job):  # this run's: within its wall time
        node = str(ev.data.get("node") or "")
        mine = status.submitted_at <= ev.time <= end
        if ev.type == "NodeFailed" and mine and node and node not in covered:
            failures[FaultKind.CRASH] = failures.get(FaultKind.CRASH, 0) + 1
            covered.add(node)
    phases: dict[str, float] = {}
    if recoveries:
        for name in ("detect", "rendezvous", "restore", "first_step"):
            phases[name] = statistics.median(r.phases[name] for r in recoveries)
    return RunFigures(job, nodes, end - start, failures, phases, len(recoveries))


def failure_model_from_run(figures: RunFigures, repair_s: float) -> FailureModel:
    """A model with one source per kind of failure the run saw, at its observed rate."""
    if not figures.failures:
        raise PlanError(
            f"--from-run {figures.job}: the job recorded no failures in "
            f"{figures.wall_s / 3600:.1f} h on {figures.nodes} nodes, so it gives no failure "
            "rate; add --failure-model PRESET|FILE for the rate (its recovery costs are still "
            "used)"
        )
    sources = tuple(
        FailureSource(
            f"{kind.value} (recorded)",
            kind,
            per_node_day=count / figures.node_days,
            repair_s=repair_s,
            citation=f"job {figures.job}: {count} in {figures.node_days:.2f} node-days",
        )
        for kind, count in sorted(figures.failures.items(), key=lambda kv: kv[0].value)
    )
    return FailureModel(
        f"from-run {figures.job}",
        sources,
        f"recorded by job {figures.job}",
        (f"failed nodes come back after {repair_s / 3600:g} h (not recorded by the job)",),
    )


def measured_from_run(figures: RunFigures, state_gb: float, base: Measured) -> Measured:
    """``base`` with the run's median detect, rendezvous and heal in place of the defaults."""
    if not figures.phases:
        return base
    restore = figures.phases["restore"]
    return replace(
        base,
        detect_small_s=figures.phases["detect"],
        detect_per_1000_nodes_s=0.0,
        rendezvous_s=figures.phases["rendezvous"],
        heal_gbps=state_gb / restore if restore > 0 else base.heal_gbps,
    )
