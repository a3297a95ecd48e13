"""A DDP model's slow rank computes longer and its peers wait, buffers or none, on real gloo ranks.

Two real processes (``tests.gloo.run_gloo``) train a small MLP under the
runtime's DDP (:class:`agents.runtime.elastic_ddp.ElasticDDP`, its collectives
timed by a :class:`agents.runtime.step_timing.StepTiming`).  The last rank
computes longer each step (a busy loop in its step, as a slow GPU or a
throttled host would): it must show the longer compute time per step and the
shorter wait, its peer the reverse.

With buffers (a BatchNorm's running statistics; the flagship LM keeps its
causal mask as one) DDP broadcasts them at the start of each forward pass: a
collective that blocks every rank until the slowest gets there, so that is
where the peers wait for a slow rank, not at the last gradient bucket.  That
broadcast counts as a wait.  Untimed, it counted as compute on every rank and
a slow rank computed as long as its peers: the straggler benchmark's LM node
held 3x slower measured 1.0x and was never called.

A rank slow after its last gradient bucket (in its optimizer step, say) is
waited for at the next collective every rank meets: the step boundary's vote
(:func:`agents.runtime.boundary.agree`, here after every step).  That wait
counts too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.faults.busy import spin
from tests.gloo import run_gloo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 8
#: steps before the clock starts (gloo's first connections, DDP's first buckets)
WARM = 2
#: seconds of extra compute per step on the slow rank (long beside a shared
#: machine's scheduling noise: the assertions compare the ranks, not the clock)
SLOW_S = 0.15


def _train(rank: int, world: int, buffers: bool, slow_after: bool) -> dict[str, Any]:
    from torch import nn

    from agents.runtime.boundary import Proposal, agree
    from agents.runtime.elastic_ddp import ElasticDDP
    from agents.runtime.failures import CollectiveFailures
    from agents.runtime.step_timing import StepTiming

    torch.manual_seed(0)
    norm: list[nn.Module] = [nn.BatchNorm1d(32)] if buffers else []
    net = nn.Sequential(nn.Linear(16, 32), *norm, nn.ReLU(), nn.Linear(32, 4))
    timing = StepTiming()
    model = ElasticDDP(net, failures=CollectiveFailures(timing))
    model.rebuild()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(WARM + STEPS):
        if step == WARM:
            timing.reset()
            timing.compute_s = timing.wait_s = 0.0
            timing.steps = 0
            timing.step_done()  # the clock starts
        opt.zero_grad()
        if rank == world - 1 and not slow_after:
            spin(SLOW_S)
        model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        if slow_after:
            if rank == world - 1:
                spin(SLOW_S)
            agree(Proposal(0, 0, 0, False, False, False), timing=timing)
        timing.step_done()
    model.drop()
    return {
        "buffers": sum(1 for _ in net.buffers()),
        "steps": timing.steps,
        "compute": timing.compute_s / max(timing.steps, 1),
        "wait": timing.wait_s / max(timing.steps, 1),
    }


#: ``(buffers, slow_after)`` of each case, by its test id
CASES = {
    "buffers": (True, False),
    "no-buffers": (False, False),
    "slow-after-the-gradients-then-a-vote": (False, True),
}


def _train_each(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Every case in turn, each with its own model, its own DDP and its own clock."""
    return {case: _train(rank, world, *args) for case, args in CASES.items()}


@pytest.fixture(scope="module")
def trained() -> list[dict[str, dict[str, Any]]]:
    """The cases' results by rank: one pair of gloo processes trains them all."""
    return run_gloo(_train_each, 2, timeout=150)


@pytest.mark.parametrize("case", list(CASES))
def test_the_slow_rank_of_a_ddp_model_computes_longer_its_peer_waits(
    trained: list[dict[str, dict[str, Any]]], case: str
) -> None:
    buffers, _ = CASES[case]
    results = [by_case[case] for by_case in trained]
    slow, healthy = results[-1], results[0]
    assert (slow["buffers"] > 0) == buffers, slow
    assert all(r["steps"] == STEPS for r in results), [r["steps"] for r in results]
    # the slow rank computes longer by about its extra time; the healthy one waits for
    # it (in the buffer broadcast, or at the last bucket), the slow one much less
    assert slow["compute"] - healthy["compute"] > SLOW_S / 2, (slow, healthy)
    assert healthy["wait"] > SLOW_S / 2, (slow, healthy)
    assert healthy["wait"] > 2 * slow["wait"], (slow, healthy)
