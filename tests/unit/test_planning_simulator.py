"""The failure simulator against closed forms, and its accounts closing."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from orchestrator.planning.api import (
    LOSS_CAUSES,
    Cost,
    FailureModel,
    FailureSource,
    Fault,
    FaultKind,
    JobShape,
    Tier,
    TierModel,
)
from orchestrator.planning.costs import recovery_model
from orchestrator.planning.presets import PRESETS
from orchestrator.planning.recommend import recommend, young_daly_s
from orchestrator.planning.simulator import simulate

pytestmark = pytest.mark.unit

DAY = 86400.0


def _tier(stop_s: float, *, rework: bool = False, block_s: float = 0.0) -> TierModel:
    cost = Cost(detect_s=stop_s, rework=rework)
    return TierModel(
        Tier.IN_PROCESS,
        {FaultKind.CRASH: cost, FaultKind.SOFTWARE: cost},
        checkpoint_block_s=block_s,
    )


def test_no_failures_trains_all_the_time() -> None:
    job = JobShape(nodes=64, spares=2)
    result = simulate(job, _tier(5.0), 7 * DAY, failures=PRESETS["none"])
    assert result.ettr == pytest.approx(1.0)
    assert sum(result.lost_gpu_h.values()) == pytest.approx(0.0)
    assert result.idle_spare_gpu_h == pytest.approx(2 * 8 * 7 * 24)


def test_checkpoints_alone_cost_their_share() -> None:
    job = JobShape(nodes=4, checkpoint_every_s=600.0)
    result = simulate(job, _tier(0.0, block_s=6.0), DAY, failures=PRESETS["none"])
    assert result.ettr == pytest.approx(600.0 / 606.0)


def test_exponential_crashes_match_the_closed_form() -> None:
    """Crashes at rate λ on the training nodes, each stopping the job for s seconds (a
    crash during a stop restarts it): the job is up when no crash came in the last s
    seconds, so ETTR = exp(-λ s)."""
    nodes, per_active_s, stop, step = 100, 1 / 600.0, 20.0, 2.0
    per_node_day = per_active_s * DAY / nodes
    model = FailureModel(
        "one kind", (FailureSource("crash", FaultKind.CRASH, per_node_day, repair_s=1.0),)
    )
    job = JobShape(nodes=nodes, spares=10, step_s=step)
    horizon = 30 * DAY
    s = stop + step / 2  # the step in flight is lost too
    expected = math.exp(-per_active_s * s)
    # one standard error of the down share: sqrt(λ H) crashes' worth of s, over H
    stderr = math.sqrt(per_active_s * horizon) * s / horizon
    for seed in range(3):
        result = simulate(job, _tier(stop), horizon, failures=model, seed=seed)
        assert result.ettr == pytest.approx(expected, abs=6 * stderr)
        assert result.exhaustions == 0


def test_a_restart_loses_the_work_since_the_checkpoint() -> None:
    job = JobShape(nodes=2, spares=1, step_s=1.0, checkpoint_every_s=30.0)
    horizon = 1000.0
    result = simulate(
        job, _tier(4.0, rework=True), horizon, schedule=[Fault(100.0, FaultKind.CRASH, 1, 50.0)]
    )
    # 100 s in, 10 s past the checkpoint at 90 s; stopped 4 s + half a step
    assert result.ettr == pytest.approx((horizon - 10.0 - 4.5) / horizon)
    assert result.lost_gpu_h["rework"] == pytest.approx(10.0 * 16 / 3600)


def test_without_spares_a_one_size_job_waits_for_the_repair() -> None:
    job = JobShape(nodes=2, spares=0, step_s=1.0)
    tier = recovery_model(job).tiers[Tier.IN_PROCESS]
    result = simulate(job, tier, 10_000.0, schedule=[Fault(100.0, FaultKind.CRASH, 1, 3000.0)])
    assert result.exhaustions == 1
    # back after its repair, then a spare once warm (its workers imported torch)
    back = 3000.0 + tier.spare_warmup_s
    assert result.lost_gpu_h["waiting"] == pytest.approx(back * 16 / 3600)
    assert (100.0, 0) in result.sizes


def test_with_nodes_min_below_size_the_job_shrinks_instead() -> None:
    job = JobShape(nodes=4, min_nodes=2, spares=0, step_s=1.0)
    tier = recovery_model(job).tiers[Tier.IN_PROCESS]
    result = simulate(job, tier, 10_000.0, schedule=[Fault(100.0, FaultKind.CRASH, 1, 3000.0)])
    assert result.lost_gpu_h["waiting"] == 0
    assert result.lost_gpu_h["smaller"] == pytest.approx(0.25 * 3000.0 * 32 / 3600, rel=0.01)
    assert [size for _, size in result.sizes if size] == [4, 3, 4]


def test_torchft_drops_the_whole_replica_group_until_it_heals() -> None:
    job = JobShape(nodes=16, step_s=1.0, state_gb=0.0)
    tier = recovery_model(job).tiers[Tier.TORCHFT]
    assert tier.drop_nodes == 8 and not tier.uses_spares
    result = simulate(job, tier, 10_000.0, schedule=[Fault(100.0, FaultKind.CRASH, 1, 1000.0)])
    away = 1000.0 + tier.rejoin_s - tier.costs[FaultKind.CRASH].stop_s - 0.5
    assert result.lost_gpu_h["smaller"] == pytest.approx(0.5 * away * 128 / 3600, rel=0.01)
    assert [size for _, size in result.sizes if size] == [16, 8, 16]


def test_torchft_shrinks_a_one_size_job_and_keeps_an_elastic_ones_floor() -> None:
    fault = [Fault(100.0, FaultKind.CRASH, 1, 1000.0)]
    one_size = JobShape(nodes=16, min_nodes=16, step_s=1.0, state_gb=0.0)
    tier = recovery_model(one_size).tiers[Tier.TORCHFT]
    result = simulate(one_size, tier, 10_000.0, schedule=fault)
    assert result.lost_gpu_h["waiting"] == 0  # torchft has no way to wait at one size
    assert [size for _, size in result.sizes if size] == [16, 8, 16]
    floor_above_a_group = JobShape(nodes=16, min_nodes=12, step_s=1.0, state_gb=0.0)
    result = simulate(floor_above_a_group, tier, 10_000.0, schedule=fault)
    assert result.lost_gpu_h["waiting"] > 0  # 8 of 16 left is below nodes.min 12
    assert result.lost_gpu_h["smaller"] == 0


def test_accounts_close_and_runs_repeat() -> None:
    """Work done plus every loss is the wall time, in every tier; one seed, one run."""
    job = JobShape(nodes=256, spares=3, step_s=2.0, checkpoint_every_s=900.0, min_nodes=250)
    model = PRESETS["llama3-stragglers"]
    for tier in recovery_model(job).tiers.values():
        result = simulate(job, tier, 20 * DAY, failures=model, seed=7)
        lost_s = sum(result.lost_gpu_h.values()) * 3600 / (job.nodes * job.gpus_per_node)
        assert result.ettr * result.horizon_s + lost_s == pytest.approx(result.horizon_s)
        assert set(result.lost_gpu_h) == set(LOSS_CAUSES)
        again = simulate(job, tier, 20 * DAY, failures=model, seed=7)
        assert again.ettr == result.ettr and again.sizes == result.sizes


def test_a_month_at_16k_gpus_simulates() -> None:
    job = JobShape(nodes=2048, gpus_per_node=8, spares=16)
    tier = recovery_model(job).tiers[Tier.IN_PROCESS]
    result = simulate(job, tier, 30 * DAY, failures=PRESETS["llama3"], seed=1)
    assert 150 < sum(result.faults.values()) < 350  # 7.76 a day
    assert 0.9 < result.ettr < 1.0


def test_young_daly_and_the_recommendation() -> None:
    assert young_daly_s(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2.0 * 3600.0))
    assert young_daly_s(0.0, 3600.0) == 86400.0
    job = JobShape(nodes=256, step_s=2.0)
    rec = recommend(job, PRESETS["llama3"], recovery_model(job), Tier.IN_PROCESS, 10 * DAY, 1)
    assert rec.spares >= 1  # a one-size job stops without one
    assert rec.ettr > rec.ettr_without_spares
    assert rec.cadence_s in [c for c, _ in rec.cadence_curve]
    stragglers = replace(job, straggler_swap=True)
    assert recovery_model(stragglers).tiers[Tier.IN_PROCESS].straggler_swap_s is not None
