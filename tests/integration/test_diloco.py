"""DiLoCo across two sites of a real local job: the outer loop, a hot-swap inside a site.

Two sites by the ``zone`` label: ``a`` (node-2) and ``b`` (node-0, node-1),
one warm spare in ``b`` (node-3), each a separate process talking gloo, on a
real etcd.  Each site trains alone (DDP among its own ranks) for
``inner_steps`` steps, then the sites average their pseudo-gradients and take
an outer Nesterov step: the run without a failure ends with the parameters of
that algorithm computed by hand in the test.  Killing node-1 in the middle of
an inner period puts the spare in its slot: it receives site ``b``'s inner
state from node-0 (not site ``a``'s), and the job ends with the parameters of
the run without a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torch.nn.functional as F
from torch import nn

from agents.sync.outer_step import OuterOptimizer
from examples.train_tiny import CLASSES, FEATURES, GLOBAL_BATCH, batch, dataset
from orchestrator.api import JobPhase
from orchestrator.spec_loader import load_job_data
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary, tiny_job, wait_for_step
from tests.chaos.sharded_jobs import assert_same_params

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 40
# nodes are taken in topology order (zone, rack, host): node-2 alone in zone a trains
# first, then node-0 and node-1 in zone b; node-3 (zone b) is the spare
ZONES = {"node-0": {"zone": "b"}, "node-1": {"zone": "b"}, "node-2": {"zone": "a"},
         "node-3": {"zone": "b"}}  # fmt: skip


def diloco_job(name: str, tmp: Path, spares: int) -> object:
    base = tiny_job(name, tmp, steps=STEPS, step_time=0.05, spares=spares).to_dict()
    base["nodes"] = {"min": 3, "max": 3, "spares": spares}
    base["sync"] = {"mode": "diloco", "inner_steps": 10}
    return load_job_data(base)


def simulate_diloco(
    steps: int, inner_steps: int, sites: list[list[int]]
) -> dict[str, torch.Tensor]:
    """examples/train_tiny.py under DiLoCo, by hand in one process: each site's DDP step is
    the mean of its ranks' gradients; every ``inner_steps`` the outer Nesterov step."""
    world = sum(len(s) for s in sites)
    x, y = dataset()
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    models = [first] + [
        type(first)(
            *[
                type(m)(m.in_features, m.out_features) if isinstance(m, nn.Linear) else m
                for m in first
            ]
        )
        for _ in sites[1:]
    ]  # noqa: E501
    for m in models[1:]:
        m.load_state_dict(first.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    anchor = [p.detach().clone() for p in first.parameters()]
    buf = [torch.zeros_like(a) for a in anchor]
    outer = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    for step in range(steps):
        for model, opt, ranks in zip(models, opts, sites, strict=True):
            grads = []
            for r in ranks:
                model.zero_grad()
                xb, yb = batch(step, r, world, x, y)
                loss = F.cross_entropy(model(xb), yb, reduction="sum") * world / GLOBAL_BATCH
                loss.backward()
                grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
            for i, p in enumerate(model.parameters()):
                p.grad = sum(g[i] for g in grads) / len(ranks)  # type: ignore[assignment]
            opt.step()
        if (step + 1) % inner_steps == 0:
            with torch.no_grad():
                for i in range(len(anchor)):
                    pgs = [anchor[i] - list(m.parameters())[i] for m in models]
                    outer.step(anchor[i], buf[i], sum(pgs) / len(pgs))
                for m in models:
                    for p, a in zip(m.parameters(), anchor, strict=True):
                        p.copy_(a)
    return {k: v.clone() for k, v in models[0].state_dict().items()}


def test_diloco_hot_swap_in_a_site_ends_as_without_failure(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    ref_dir.mkdir()
    run_dir.mkdir()
    lines: list[str] = []
    with quiet_run(diloco_job("diloco-ref", ref_dir, spares=0), lines, node_labels=ZONES) as run:
        reference = run.wait()
    assert reference.phase is JobPhase.SUCCEEDED, summary(reference, lines)
    # the job did what DiLoCo does: sites [node-2] and [node-0, node-1], 4 outer steps
    assert_same_params(torch.load(ref_dir / "final.pt"), simulate_diloco(STEPS, 10, [[0], [1, 2]]))

    lines = []
    with quiet_run(diloco_job("diloco-kill", run_dir, spares=1), lines, node_labels=ZONES) as run:
        wait_for_step(run, 15)
        run.kill_node("node-1")
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries >= 1, summary(result, lines)
    assert_exactly_once(run_dir, STEPS)
    assert_same_params(torch.load(run_dir / "final.pt"), torch.load(ref_dir / "final.pt"))
