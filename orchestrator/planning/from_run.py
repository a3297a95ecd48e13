"""A failure model and recovery costs from what a job recorded in etcd.

Read through the observers' own readers: the job's status (its nodes and
wall time), its :class:`~orchestrator.observe.records.RecoveryRecord` s (each
failure's cause, nodes and phases) and its ``NodeFailed`` events (a spare that
died leaves no recovery).  The failure rate is failures per node-day over the
run's wall time; the recovery costs are the median phases of its recoveries.
:func:`recorded_run` gives the same records as a run to replay
(:mod:`orchestrator.planning.replay`): each recovery at its time with its cost,
beside the effective training the job measured
(:mod:`orchestrator.observe.training_time`, the status's ``training_time``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.records import RecoveryRecord
from orchestrator.planning.api import (
    FailureModel,
    FailureSource,
    FaultKind,
    PlanError,
    RecordedFault,
    RecordedRun,
    Tier,
)
from orchestrator.planning.costs import Measured
from orchestrator.planning.peers_records import waited_s
from orchestrator.state import events, keys, records
from orchestrator.state.jobs import read_spec, read_status

__all__ = [
    "RunFigures",
    "failure_model_from_run",
    "measured_from_run",
    "read_run",
    "recorded_run",
]

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


def recorded_run(client: EtcdClient, job: str) -> RecordedRun:
    """``job``'s latest run as its records give it: every recovery that began after the
    first step at its time, its cost (the failure to the first step of the generation
    that replaced the broken one, and the steps trained again) and any wait for a spare
    still starting (its plan's reason); the checkpoint stalls, the end after the latest
    step, and the effective training the job measured (its status's ``training_time``).

    Raises:
        PlanError: no such job, or it has not trained yet.
    """
    status = read_status(client, job)
    measured = status.training_time if status is not None else None
    if status is None or measured is None or status.train_started_at is None:
        raise PlanError(
            f"{job}: no job of that name that has trained in this etcd (see `ringmaster "
            "status` for the jobs it holds, or pass --etcd for another)"
        )
    spec, _ = read_spec(client, job)
    first = status.train_started_at
    last = status.last_step_at if status.last_step_at is not None else first
    found = records.read_all(client, keys.job_recoveries(job), RecoveryRecord).values()
    recoveries = sorted(
        (r for r in found if r.run == status.run and r.failure_at >= first),
        key=lambda r: r.failure_at,
    )
    faults = []
    for r in recoveries:
        waited = waited_s(r.reason)
        faults.append(
            RecordedFault(
                at=r.failure_at - first,
                stop_s=r.total_s,
                rework_s=r.steps_rerun * measured.step_s,
                warm_spare=waited == 0,
                waited_s=waited,
            )
        )
    restart = status.recovery == "restart"
    return RecordedRun(
        name=f"job {job}, run {status.run}",
        tier=Tier.RESTART if restart else Tier.IN_PROCESS,
        window_s=measured.since_first_step_s,
        step_s=measured.step_s,
        nodes=spec.nodes.max,
        spares=spec.nodes.spares,
        faults=tuple(faults),
        measured=measured.effective,
        in_flight=False,  # a recovery's time runs from the failure, as the measure counts it
        checkpoint_s=measured.checkpoint_s,
        tail_s=max(0.0, measured.since_first_step_s - (last - first)),
        source=f"job {job}'s records in etcd",
    )
