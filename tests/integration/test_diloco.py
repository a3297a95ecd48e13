"""DiLoCo across two sites of a real local job: the outer loop, a hot-swap inside a site.

Two sites by the ``zone`` label: ``a`` (node-2) and ``b`` (node-0, node-1),
one warm spare in ``b`` (node-3, started once the job trains), each a
separate process talking gloo, on a real etcd.  Each site trains alone (DDP among its own ranks) for
``inner_steps`` steps, then the sites average their pseudo-gradients and take
an outer Nesterov step (Streaming DiLoCo: two fragments at staggered steps,
4-bit pseudo-gradients, results used two steps after they start).  node-1 of
site ``b`` is killed mid-run and the spare takes its slot: it receives site
``b``'s inner state from the other node of ``b`` (not site ``a``'s), and the
job ends with the parameters of the algorithm computed by hand in the test,
as if nothing had failed: bit for bit up to float rounding.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agents.sync.outer_step import (
    OuterOptimizer,
    average,
    flatten,
    pseudo_gradient,
    write_back,
)
from agents.sync.quantize import decode, encode
from agents.sync.schedule import FragmentSchedule, cut_fragments
from examples.train_tiny import CLASSES, FEATURES, GLOBAL_BATCH, batch, dataset
from orchestrator import jobs
from orchestrator.api import JobPhase
from orchestrator.local_run import LocalRun
from orchestrator.spec import JobSpec
from orchestrator.spec_loader import load_job_data
from orchestrator.spec_sync import SyncSpec
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary, tiny_job, wait_for_step
from tests.chaos.sharded_jobs import assert_same_params

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 40
# node-2 alone in zone a; node-0 and node-1 in zone b, and node-3, the spare
ZONES = {"node-0": {"zone": "b"}, "node-1": {"zone": "b"}, "node-2": {"zone": "a"},
         "node-3": {"zone": "b"}}  # fmt: skip


DILOCO = {"mode": "diloco", "inner_steps": 10}
STREAMING = {
    "mode": "streaming_diloco",
    "inner_steps": 10,
    "fragments": 2,
    "delay_steps": 2,
    "outer_quantization": "4bit",
}


def wait_for_spare(run: LocalRun, node: str, timeout: float = 60) -> None:
    """Wait until ``node`` waits as a warm spare of the run's job."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = jobs.read_status(run.client, run.spec.name)
        if status is not None and node in status.spare_nodes:
            return
        time.sleep(0.1)
    raise AssertionError(f"{node} never became a spare")


def diloco_job(name: str, tmp: Path, spares: int, sync: dict[str, object]) -> JobSpec:
    # slow enough steps that the spare is warm before the end: it starts once the job runs
    base = tiny_job(name, tmp, steps=STEPS, step_time=0.3, spares=spares).to_dict()
    base["nodes"] = {"min": 3, "max": 3, "spares": spares}
    base["sync"] = sync
    return load_job_data(base)


def simulate(steps: int, sync: SyncSpec, sites: list[list[int]]) -> dict[str, torch.Tensor]:
    """examples/train_tiny.py under ``sync``, by hand in one process.

    Each site's DDP step is the mean of its ranks' gradients.  When a fragment's sync
    starts, each site's pseudo-gradient is taken (and encoded as it would travel);
    ``delay_steps`` later the sites' average goes through the outer Nesterov step and
    each site's fragment becomes the new anchor plus what its inner steps changed since.
    """
    world = sum(len(s) for s in sites)
    x, y = dataset()
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    models = [first] + [copy.deepcopy(first) for _ in sites[1:]]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    runs = cut_fragments([p.numel() for p in first.parameters()], sync.fragments)
    frags = [[[list(m.parameters())[i] for i in run] for run in runs] for m in models]
    anchors = [flatten(f) for f in frags[0]]
    bufs = [torch.zeros_like(a) for a in anchors]
    outer = OuterOptimizer.of_spec(sync.outer_optimizer)
    schedule = FragmentSchedule(sync.inner_steps, sync.fragments, sync.delay_steps)
    kind = sync.outer_quantization
    started: dict[int, list[torch.Tensor]] = {}
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
        done = step + 1
        f = schedule.starts_at(done)
        if f is not None:
            started[f] = [pseudo_gradient(anchors[f], site[f]) for site in frags]
        f = schedule.applies_at(done)
        if f is not None:
            mine = started.pop(f)
            n = anchors[f].numel()
            avg = average([(1.0, decode(encode(g, kind), kind, n)) for g in mine])
            old = anchors[f].clone()
            outer.step(anchors[f], bufs[f], avg)
            for site, g in zip(frags, mine, strict=True):
                moved = flatten(site[f]) - (old - g)
                write_back(site[f], anchors[f] + moved if sync.delay_steps else anchors[f])
    return {k: v.clone() for k, v in models[0].state_dict().items()}


@pytest.mark.parametrize("sync", [DILOCO, STREAMING], ids=["diloco", "streaming"])
def test_hot_swap_in_a_site_ends_as_the_algorithm_by_hand(
    tmp_path: Path, sync: dict[str, object]
) -> None:
    lines: list[str] = []
    spec = diloco_job("diloco-kill", tmp_path, 1, sync)
    run = quiet_run(spec, lines, node_labels=ZONES)
    # the spare starts once the job trains: the first generation holds both sites
    run.node_names = lambda: ["node-0", "node-1", "node-2"]  # type: ignore[method-assign]
    with run:
        wait_for_step(run, 1)
        run.add_node("node-3", rack="rack-1")
        wait_for_spare(run, "node-3")
        run.kill_node("node-1")  # site b's: the spare (zone b too) takes its slot
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries >= 1, summary(result, lines)
    assert_exactly_once(tmp_path, STEPS)
    # sites [node-2] and [the two of zone b], as if nothing had failed
    assert_same_params(torch.load(tmp_path / "final.pt"), simulate(STEPS, spec.sync, [[0], [1, 2]]))
