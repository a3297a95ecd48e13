"""A plan for one job: its shape from the job file, the recommendation, every tier beside it.

:func:`job_shape` reads what the job file says (nodes, spares, ``nodes.min``,
checkpoint cadence, heartbeat, straggler action); :func:`make_plan` runs the
recommendation for the job's own tier and simulates the other tiers on the
same faults, each at its own Young/Daly cadence and the same spares.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from orchestrator.planning.api import FailureModel, JobShape, RecoveryModel, SimResult, Tier
from orchestrator.planning.recommend import Recommendation, mtbf_s, recommend, young_daly_s
from orchestrator.planning.simulator import simulate
from orchestrator.spec.job import JobSpec, RecoveryMode, StragglerAction

__all__ = ["Plan", "job_shape", "make_plan", "tier_of"]


@dataclass
class Plan:
    """What ``ringmaster plan`` prints and draws."""

    job: JobShape
    failures: FailureModel
    recovery: RecoveryModel
    horizon_s: float
    recommendation: Recommendation
    tiers: dict[Tier, SimResult] = field(default_factory=dict)


def tier_of(spec: JobSpec) -> Tier:
    """The tier a job recovers in (``auto`` plans for the in-process tier)."""
    mode = spec.fault_tolerance.recovery
    return Tier.RESTART if mode is RecoveryMode.RESTART else Tier.IN_PROCESS


def job_shape(
    spec: JobSpec,
    *,
    nodes: int | None,
    gpus_per_node: int | None,
    step_s: float,
    state_gb: float,
    replica_nodes: int = 1,
    min_nodes: int | None = None,
) -> JobShape:
    """The planner's view of a job file; ``nodes`` and ``gpus_per_node`` override it.

    ``nodes.min`` is kept as the job file says it, except that a job file of
    one size (``min`` = ``max``) keeps one size at any ``nodes``; ``min_nodes``
    overrides it.  The checkpoint cadence is ``checkpoint.every_seconds``, else ``every_steps``
    times the step, else an hour (the recommendation replaces it anyway).
    """
    every = spec.checkpoint.every_seconds or spec.checkpoint.every_steps * step_s or 3600.0
    size = nodes or spec.nodes.max
    # a job file of one size (min = max) keeps one size at any --nodes
    fixed = spec.nodes.min >= spec.nodes.max
    floor = size if fixed else min(spec.nodes.min, size)
    if min_nodes is not None:
        floor = min(min_nodes, size)
    return JobShape(
        nodes=size,
        gpus_per_node=gpus_per_node or spec.resources.gpus or spec.nproc_per_node,
        spares=spec.nodes.spares,
        min_nodes=floor,
        step_s=step_s,
        state_gb=state_gb,
        checkpoint_every_s=every,
        replica_nodes=replica_nodes,
        straggler_swap=spec.fault_tolerance.stragglers.action is StragglerAction.SWAP,
        heartbeat_s=spec.fault_tolerance.heartbeat_interval.total_seconds(),
    )


def make_plan(
    job: JobShape,
    failures: FailureModel,
    recovery: RecoveryModel,
    tier: Tier,
    horizon_s: float,
    seeds: int = 3,
) -> Plan:
    """The recommendation for ``tier``, and every tier simulated beside it."""
    rec = recommend(job, failures, recovery, tier, horizon_s, seeds)
    plan = Plan(job, failures, recovery, horizon_s, rec)
    for other, model in recovery.tiers.items():
        if other is tier and rec.result is not None:
            plan.tiers[other] = rec.result
            continue
        every = young_daly_s(model.checkpoint_block_s, mtbf_s(job, failures, model))
        shaped = replace(job, spares=rec.spares, checkpoint_every_s=every)
        plan.tiers[other] = simulate(shaped, model, horizon_s, failures=failures, seed=0)
    return plan
