"""A recorded run replayed through the simulator: spares that warm up, faults with their
recorded costs, and benchmarks/peers.py's goodput rows read from its JSON line."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.planning.api import (
    Cost,
    Fault,
    FaultKind,
    JobShape,
    PlanError,
    RecordedFault,
    RecordedRun,
    Tier,
    TierModel,
)
from orchestrator.planning.peers_records import runs_from_peers, waited_s
from orchestrator.planning.replay import (
    effective,
    model,
    replay,
    spare_warmup_from,
    warm_stop_from,
)
from orchestrator.planning.simulator import simulate

pytestmark = pytest.mark.unit

#: The goodput rows of one benchmarks/peers.py run (docs/peers.md, "Results": load
#: average 8 on 2 cores), as its JSON line gave them; the other rows left out.
FRESH_RUN: dict[str, Any] = {
    "step_time_s": 0.05,
    "ringmaster_steps_per_s": 18.015,
    "tier0_steps_per_s": 18.11,
    "ringmaster_goodput15_kills": 4,
    "ringmaster_goodput15_steps": 909,
    "ringmaster_goodput15_steps_lost": 0,
    "ringmaster_goodput15_next_step_each_s": [0.233, 3.016, 1.628, 4.81],
    "ringmaster_goodput15_spare_warm_at_kill": [True, False, False, False],
    "ringmaster_goodput15_events": [
        {"plan": "generation 2: node-0, node-2 (node-0 replaces node-1)"},
        {
            "plan": "generation 3: node-3, node-2 (node-3 replaces node-0; the spare was still "
            "starting: 2.5s)"
        },
        {
            "plan": "generation 4: node-3, node-4 (node-4 replaces node-2; the spare was still "
            "starting: 1.4s)"
        },
        {
            "plan": "generation 5: node-5, node-4 (node-5 replaces node-3; the spare was still "
            "starting: 4.6s)"
        },
    ],
    "ringmaster_goodput15_effective": 0.84097,
    "tier0_goodput15_kills": 4,
    "tier0_goodput15_steps_lost": 15,
    "tier0_goodput15_next_step_each_s": [0.311, 6.738, 9.276, None],
    "tier0_goodput15_spare_warm_at_kill": [True, True, True, True],
    "tier0_goodput15_events": [],
    "tier0_goodput15_effective": 0.57427,
    "windows_s": {"15": 60.0},
}


def _spare_tier(warmup_s: float, stop_s: float = 1.0) -> TierModel:
    return TierModel(
        Tier.IN_PROCESS,
        {FaultKind.CRASH: Cost(detect_s=stop_s, in_flight=False)},
        spare_warmup_s=warmup_s,
    )


def test_a_failure_that_finds_the_spare_starting_waits_for_it() -> None:
    """2 nodes + 1 spare; the node killed at 10 s starts again at once and is warm 20 s
    later; a second kill at 20 s finds no warm spare and waits the 10 s left."""
    job = JobShape(nodes=2, spares=1, step_s=0.1, state_gb=0.0)
    kills = [Fault(10.0, FaultKind.CRASH, 1, 0.0), Fault(20.0, FaultKind.CRASH, 1, 0.0)]
    result = simulate(job, _spare_tier(20.0), 100.0, schedule=kills)
    assert result.exhaustions == 1
    # 1 s for the first; 10 s of waiting + 1 s for the second
    assert result.ettr == pytest.approx((100.0 - 1.0 - 11.0) / 100.0)
    assert (20.0, 0) in result.sizes and (31.0, 2) in result.sizes
    warm = simulate(job, _spare_tier(5.0), 100.0, schedule=kills)
    assert warm.exhaustions == 0 and warm.ettr == pytest.approx(0.98)


def test_a_fault_with_a_recorded_cost_replaces_the_tiers() -> None:
    job = JobShape(nodes=2, spares=2, step_s=0.1, state_gb=0.0)
    recorded = Cost(detect_s=4.0, in_flight=False, rework_s=2.5)
    result = simulate(
        job,
        _spare_tier(0.0, stop_s=1.0),
        100.0,
        schedule=[Fault(50.0, FaultKind.CRASH, 1, 0.0, cost=recorded)],
    )
    assert result.ettr == pytest.approx((100.0 - 4.0 - 2.5) / 100.0)
    assert result.lost_gpu_h["rework"] == pytest.approx(2.5 * 2 * 8 / 3600)


def test_the_peers_json_gives_each_kill_its_time_cost_and_wait() -> None:
    runs = {r.name: r for r in runs_from_peers(FRESH_RUN)}
    swap = runs["ringmaster-in-process, kill every 15 s"]
    assert swap.tier is Tier.IN_PROCESS and swap.spares == 1 and swap.window_s == 60.0
    assert [f.at for f in swap.faults] == [7.5, 22.5, 37.5, 52.5]
    step = 1 / 18.015
    assert swap.faults[1].stop_s == pytest.approx(3.016 - step)
    assert [f.waited_s for f in swap.faults] == [0.0, 2.5, 1.4, 4.6]
    assert [f.warm_spare for f in swap.faults] == [True, False, False, False]
    restart = runs["ringmaster-restart, kill every 15 s"]
    assert restart.faults[-1].stop_s is None  # no step after it within the window
    # 15 steps lost, shared by the three kills the job came back from
    assert sum(f.rework_s for f in restart.faults) == pytest.approx(15 / 18.11)


def test_the_fresh_runs_15s_row_is_predicted_within_3_points() -> None:
    """Replayed with each kill's cost, and modelled from a warm swap and the spare's
    warm-up: the model finds the same three kills without a warm spare."""
    runs = runs_from_peers(FRESH_RUN)
    swaps = [r for r in runs if r.tier is Tier.IN_PROCESS]
    swap = swaps[0]
    assert effective(swap, replay(swap)) == pytest.approx(swap.measured, abs=0.03)
    warm, warmup = warm_stop_from(swaps), spare_warmup_from(swaps)
    assert warm == pytest.approx(0.233 - 1 / 18.015)
    assert warmup == pytest.approx(15.0 + (2.5 + 1.4 + 4.6) / 3)
    assert warm is not None and warmup is not None
    modelled = model(swap, warm, warmup)
    assert modelled.exhaustions == 3
    assert effective(swap, modelled) == pytest.approx(swap.measured, abs=0.03)
    # without the warm-up every kill would find a warm spare: 5 points too optimistic
    assert effective(swap, model(swap, warm, 0.0)) - swap.measured > 0.05


def test_the_replays_accounts_close() -> None:
    run = RecordedRun(
        name="a run",
        tier=Tier.IN_PROCESS,
        window_s=100.0,
        step_s=0.1,
        nodes=2,
        spares=1,
        faults=(RecordedFault(10.0, 2.0, rework_s=1.0), RecordedFault(60.0, None)),
        measured=0.0,
        in_flight=False,
        checkpoint_s=3.0,
        tail_s=5.0,
    )
    result = replay(run)
    assert result.horizon_s == 95.0
    lost_s = sum(result.lost_gpu_h.values()) * 3600 / 2
    assert result.ettr * result.horizon_s + lost_s == pytest.approx(result.horizon_s)
    # trains 10 s, stops 2, trains 48 s, never again; the stalls and the re-run work out
    assert effective(run, result) == pytest.approx((58.0 - 3.0 - 1.0) / 100.0, abs=0.005)


def test_a_plan_reason_says_how_long_the_replacement_waited() -> None:
    assert waited_s("node-3 replaces node-0; the spare was still starting: 2.5s") == 2.5
    assert waited_s("node-3 replaces node-0; no spare for 12.0s") == 12.0
    assert waited_s("node-2 replaces node-0") == 0.0


def test_a_json_without_goodput_rows_is_refused_in_one_line() -> None:
    with pytest.raises(PlanError, match=r"out\.json: no 'windows_s'.*benchmarks/peers\.py"):
        runs_from_peers({"step_time_s": 0.05}, "out.json")
    with pytest.raises(PlanError, match="no goodput row"):
        runs_from_peers({"windows_s": {"15": 60.0}}, "out.json")
    bad = {**FRESH_RUN, "ringmaster_goodput15_next_step_each_s": [0.2]}
    with pytest.raises(PlanError, match="4 kills but 1 times"):
        runs_from_peers(bad, "out.json")
