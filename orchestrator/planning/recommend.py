"""How many spares and how often to checkpoint: the rule, and the sweeps behind it.

**Cadence.** The baseline is Young/Daly: checkpoint every ``sqrt(2 * C * MTBF)``
seconds of training, where ``C`` is what one save blocks training and MTBF the
mean time between the faults that send the job back to its last checkpoint
(for the in-process tier only the ones that end every worker; for the restart
tiers every failure).  The simulator then tries multiples of it around it and
keeps the best (the formula assumes a fault costs only the lost work, and
nothing else in the run changes with the cadence).

**Spares.** A warm spare costs its GPUs for the whole run and pays back only
while a node is out.  The planner keeps the number of spares ``S`` that
maximises the work done per GPU reserved, ``ETTR(S) * N / (N + S)``: one more
spare is worth holding while the GPU-hours it saves exceed the GPU-hours it
stands idle.  The sweep runs from none to well past the nodes expected out at
once (Little's law: failure rate x nodes x repair time, plus four standard
deviations), every count on the same drawn faults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from orchestrator.planning.api import (
    FailureModel,
    FaultKind,
    JobShape,
    RecoveryModel,
    SimResult,
    Tier,
    TierModel,
)
from orchestrator.planning.simulator import simulate

__all__ = ["CADENCE_STEPS", "Recommendation", "mtbf_s", "recommend", "young_daly_s"]

#: Multiples of the Young/Daly cadence the simulator tries.
CADENCE_STEPS = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)
#: Bounds on a recommended cadence: a minute to a day.
CADENCE_BOUNDS = (60.0, 86400.0)
#: Spare counts tried at most (evenly spread when the range is wider).
MAX_SPARE_POINTS = 24


@dataclass
class Recommendation:
    """The plan for one tier.

    Attributes:
        spares: recommended warm spares.
        cadence_s: recommended seconds of training between checkpoints.
        young_daly_s: the Young/Daly cadence it started from.
        mtbf_s: mean seconds between faults that send the job back to a checkpoint.
        ettr: expected ETTR with the recommended spares and cadence.
        ettr_without_spares: the same cadence, no spares.
        spare_curve: ``(spares, ETTR, work per GPU reserved)`` per count tried.
        cadence_curve: ``(cadence s, ETTR)`` per cadence tried.
        result: one simulated run at the recommendation (the first seed).
    """

    tier: Tier
    spares: int
    cadence_s: float
    young_daly_s: float
    mtbf_s: float
    ettr: float
    ettr_without_spares: float
    spare_curve: list[tuple[int, float, float]] = field(default_factory=list)
    cadence_curve: list[tuple[float, float]] = field(default_factory=list)
    result: SimResult | None = None


def mtbf_s(job: JobShape, failures: FailureModel, tier: TierModel) -> float:
    """Mean seconds between the faults that cost ``tier`` the work since the checkpoint."""
    rate = 0.0
    for s in failures.sources:
        cost = tier.costs.get(s.kind)
        if cost is not None and cost.rework and s.kind is not FaultKind.STRAGGLER:
            rate += s.per_node_day * job.nodes / 86400.0
    return math.inf if rate <= 0 else 1.0 / rate


def young_daly_s(block_s: float, mtbf: float) -> float:
    """``sqrt(2 * C * MTBF)``, kept within :data:`CADENCE_BOUNDS`."""
    low, high = CADENCE_BOUNDS
    if block_s <= 0 or math.isinf(mtbf):
        return high
    return min(high, max(low, math.sqrt(2.0 * block_s * mtbf)))


def expected_out(job: JobShape, failures: FailureModel) -> float:
    """Nodes out for repair at any moment, on average (Little's law)."""
    return sum(
        s.per_node_day / 86400.0 * job.nodes * s.nodes * s.repair_s
        for s in failures.sources
        if s.kind in (FaultKind.CRASH, FaultKind.HANG, FaultKind.PREEMPTION)
    )


def spare_counts(job: JobShape, failures: FailureModel) -> list[int]:
    """The spare counts to try: 0 to four standard deviations past the nodes out."""
    out = expected_out(job, failures)
    widest = max((s.nodes for s in failures.sources), default=1)
    top = max(1, math.ceil(out + 4.0 * math.sqrt(out) + widest))
    if top < MAX_SPARE_POINTS:
        return list(range(top + 1))
    return sorted({round(i * top / (MAX_SPARE_POINTS - 1)) for i in range(MAX_SPARE_POINTS)})


def _mean_ettr(
    job: JobShape, tier: TierModel, failures: FailureModel, horizon_s: float, seeds: int
) -> tuple[float, SimResult]:
    runs = [simulate(job, tier, horizon_s, failures=failures, seed=s) for s in range(seeds)]
    return sum(r.ettr for r in runs) / len(runs), runs[0]


def recommend(
    job: JobShape,
    failures: FailureModel,
    recovery: RecoveryModel,
    tier: Tier,
    horizon_s: float,
    seeds: int = 3,
) -> Recommendation:
    """Spares and cadence for ``job`` under ``tier`` (see the module docstring)."""
    model = recovery.tiers[tier]
    mtbf = mtbf_s(job, failures, model)
    baseline = young_daly_s(model.checkpoint_block_s, mtbf)
    counts = spare_counts(job, failures) if model.uses_spares else [0]
    spare_curve = []
    for count in counts:
        ettr, _ = _mean_ettr(
            replace(job, spares=count, checkpoint_every_s=baseline),
            model,
            failures,
            horizon_s,
            seeds,
        )
        held = job.nodes + count
        spare_curve.append((count, ettr, ettr * job.nodes / held))
    best = max(spare_curve, key=lambda row: (round(row[2], 5), -row[0]))
    spares = best[0]
    cadence_curve = []
    for step in CADENCE_STEPS:
        every = min(CADENCE_BOUNDS[1], max(CADENCE_BOUNDS[0], baseline * step))
        ettr, _ = _mean_ettr(
            replace(job, spares=spares, checkpoint_every_s=every), model, failures, horizon_s, seeds
        )
        cadence_curve.append((every, ettr))
    cadence, ettr = max(cadence_curve, key=lambda row: (round(row[1], 5), row[0]))
    chosen = replace(job, spares=spares, checkpoint_every_s=cadence)
    ettr, result = _mean_ettr(chosen, model, failures, horizon_s, seeds)
    without, _ = _mean_ettr(replace(chosen, spares=0), model, failures, horizon_s, seeds)
    return Recommendation(
        tier=tier,
        spares=spares,
        cadence_s=cadence,
        young_daly_s=baseline,
        mtbf_s=mtbf,
        ettr=ettr,
        ettr_without_spares=without,
        spare_curve=spare_curve,
        cadence_curve=cadence_curve,
        result=result,
    )
