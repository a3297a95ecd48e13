"""A real slow node swapped for a warm spare, nothing lost: the final parameters equal a
fault-free run's.  A DDP job, and a sharded one (FSDP2's HSDP, its slow rank's slice
taken over from its twin; FSDP2 with buddy copies as a longer variant).

Real processes (``LocalRun``: a private etcd, a controller, three node agents, two
active and one warm spare, gloo).  Once the job trains, one active node's workers get
a duty cycle from outside, as a throttled machine would: SIGSTOP for 60 ms of every
100 ms.  With ``fault_tolerance.stragglers.action: swap`` the controller calls it a
straggler, the spare takes its slot in a planned switch, the slow node is
quarantined, and the job finishes with every step applied exactly once and the same
parameters as a run without the slowdown (computed: :mod:`tests.chaos.tiny_by_hand`).
No other straggler call is made in the whole run: not before the slowdown, not on
the healthy node, not after the swap.  The sharded job's steps are timed from FSDP2's
own collectives (:mod:`agents.state.sharded_timing`): without them it would never
be called.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from orchestrator.local_run import LocalRun, RunResult
from orchestrator.spec.job import JobSpec, StragglerAction
from orchestrator.state import events, jobs, keys, records
from orchestrator.state.records import NodeRecord, Plan
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary, tiny_job, wait_for_step
from tests.chaos.sharded_jobs import assembled, assert_same_params, fault_free, sharded_job
from tests.chaos.tiny_by_hand import tiny_final
from tests.faults.duty_cycle import DutyCycle

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 400


def _swapping(spec: JobSpec) -> JobSpec:
    ft = spec.fault_tolerance
    ft.heartbeat_interval = timedelta(seconds=1)
    ft.stragglers.action = StragglerAction.SWAP
    ft.stragglers.threshold, ft.stragglers.windows = 1.3, 3
    ft.stragglers.min_gain = timedelta(0)
    ft.stragglers.confirm = timedelta(seconds=1)  # the default 5 s outlasts this short job
    return spec


def _slow_down_one_node(run: LocalRun, spec: JobSpec, lines: list[str]) -> tuple[str, RunResult]:
    """Once the job trains, duty-cycle its second node until the swap; the run's result."""
    cycle: DutyCycle | None = None
    try:
        wait_for_step(run, 60)
        plan = records.read(run.client, keys.job_plan(spec.name), Plan)
        assert plan is not None and plan.generation == 1, plan
        slow = plan.members[1].node
        before = events.list_events(run.client, spec.name)
        assert not [e for e in before if e.type.startswith("Straggler")], before
        node = records.read(run.client, keys.job_node(spec.name, slow), NodeRecord)
        assert node is not None and node.worker_pids, node
        cycle = DutyCycle(node.worker_pids)
        cycle.start()
        deadline = time.monotonic() + 60
        while not any(
            e.type == "StragglerSwapped" for e in events.list_events(run.client, spec.name)
        ):
            assert time.monotonic() < deadline, summary(run.wait(), lines)
            time.sleep(0.1)
        # the controller writes the status at the end of the tick that emitted the event
        # (seen once: read between the two, the status was the tick before's)
        while not (status := jobs.read_status(run.client, spec.name)) or not (
            status.quarantined or status.phase.terminal or time.monotonic() > deadline
        ):
            time.sleep(0.05)
        assert status is not None and status.quarantined == [slow], status
    finally:
        if cycle is not None:
            cycle.done.set()
    return slow, run.wait()


def _assert_one_call_and_swap(result: RunResult, lines: list[str], slow: str) -> None:
    assert result.phase is JobPhase.SUCCEEDED and result.step == STEPS, summary(result, lines)
    kinds = [e.type for e in result.events]
    # one call in the whole run: none on healthy nodes, before the slowdown (60 steps) or
    # after the swap (the spare and the other node train the rest of the run's 400 steps)
    assert "NodeFailed" not in kinds and "Restart" not in kinds, kinds
    (called,) = [e for e in result.events if e.type == "Straggler"]
    assert called.data["node"] == slow and called.data["slowdown"] >= 1.3, called
    (swapped,) = [e for e in result.events if e.type == "StragglerSwapped"]
    assert f"replaces {slow} (a straggler" in swapped.message, swapped.message
    cost = float(swapped.message.split("it had cost the job ")[1].split("s,")[0])
    assert cost >= 1.0, swapped.message  # not before it had cost the job `confirm`
    generations = [e.message for e in result.events if e.type == "Generation"]
    assert len(generations) == 2 and f"replaces {slow}" in generations[1], generations


def test_a_slowed_node_is_swapped_for_the_spare_and_nothing_is_lost(tmp_path: Path) -> None:
    reference = tiny_final(STEPS)  # a fault-free run's (tests/chaos/tiny_by_hand.py)
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    lines: list[str] = []
    spec = _swapping(tiny_job("straggler-swap", swap_dir, steps=STEPS, spares=1))
    with quiet_run(spec, lines) as run:
        slow, result = _slow_down_one_node(run, spec, lines)
    _assert_one_call_and_swap(result, lines, slow)
    assert_exactly_once(swap_dir, STEPS)
    final = torch.load(swap_dir / "final.pt")
    assert final.keys() == reference.keys()
    for k in final:
        assert torch.allclose(final[k], reference[k], rtol=1e-6, atol=1e-7), f"{k} differs"


@pytest.mark.parametrize(
    ("sharding", "redundancy"),
    [
        # short form: the DDP job's swap above; HSDP's slice from its twin:
        # chaos/test_sharded_recovery.py; FSDP2's step timing: integration/test_sharded_timing.py
        pytest.param("hsdp", None, marks=pytest.mark.long),
        pytest.param("fsdp", 1, marks=pytest.mark.long),
    ],
    ids=["hsdp-twin", "fsdp-buddy"],
)
def test_a_slowed_node_of_a_sharded_job_is_swapped_and_nothing_is_lost(
    tmp_path: Path, sharding: str, redundancy: int | None
) -> None:
    """``hsdp`` over two nodes of one worker (each node a replica): the slow node's
    replica is its twin; ``fsdp`` with a buddy copy every step: its buddy's copy."""
    lines: list[str] = []
    spec = sharded_job(
        f"straggler-{sharding}",
        tmp_path,
        sharding,
        nodes=2,
        nproc=1,
        steps=STEPS,
        redundancy=redundancy,
    )
    with quiet_run(_swapping(spec), lines) as run:
        slow, result = _slow_down_one_node(run, spec, lines)
    _assert_one_call_and_swap(result, lines, slow)
    assert_exactly_once(tmp_path, STEPS)  # 0 steps lost: none applied twice
    assert_same_params(assembled(tmp_path / "out"), fault_free(STEPS))
