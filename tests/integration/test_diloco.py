"""DiLoCo across two sites of a real local job: the outer loop, a hot-swap inside a site.

Two sites by the ``zone`` label: ``a`` (node-2) and ``b`` (node-0, node-1),
one warm spare in ``b`` (node-3, started once the job trains), each a
separate process talking gloo, on a real etcd.  Each site trains alone (DDP among its own ranks) for
``inner_steps`` steps, then the sites average their pseudo-gradients and take
an outer Nesterov step (Streaming DiLoCo at the paper's defaults: two fragments
at staggered steps, pseudo-gradients as 4-bit floats, results used two steps
after they start and merged half and half with each site's own fragment).  node-1 of
site ``b`` is killed mid-run and the spare takes its slot: it receives site
``b``'s inner state from the other node of ``b`` (not site ``a``'s), and the
job ends with the parameters of the algorithm computed by hand in the test,
as if nothing had failed: bit for bit up to float rounding.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

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
from orchestrator.api import JobPhase
from orchestrator.local_run import LocalRun
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from orchestrator.spec.sync import SyncSpec
from orchestrator.state import jobs
from orchestrator.state.jobs import plan_resume
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary, tiny_job, wait_for_step
from tests.chaos.sharded_jobs import assert_same_params
from tests.faults.partitioned_job import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 60
# node-2 alone in zone a; node-0 and node-1 in zone b, and node-3, the spare
ZONES = {
    "node-0": {"zone": "b"},
    "node-1": {"zone": "b"},
    "node-2": {"zone": "a"},
    "node-3": {"zone": "b"},
}


DILOCO = {"mode": "diloco", "inner_steps": 10}
#: at the paper's defaults: e3m0 pseudo-gradients, alpha 0.5
STREAMING = {"mode": "streaming_diloco", "inner_steps": 10, "fragments": 2, "delay_steps": 2}


def spare_ready(run: LocalRun, node: str, go: Path) -> None:
    """Wait until ``node`` waits as a warm spare, then let the held job go on."""
    wait_for_spare(run, node)
    go.touch()


def wait_for_spare(run: LocalRun, node: str, timeout: float = 120) -> None:
    """Wait until ``node`` waits as a warm spare of the run's job."""
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        status = jobs.read_status(run.client, run.spec.name)
        if status is not None and node in status.spare_nodes:
            return
        if status is not None and status.phase.terminal:
            break
        time.sleep(0.1)
    raise AssertionError(f"{node} never became a spare ({status})")


#: The step the jobs with a spare started late wait at, until the spare is warm.
HOLD_AT = 5


def diloco_job(
    name: str,
    tmp: Path,
    spares: int,
    sync: dict[str, object],
    step_time: float = 0.3,
    seed_by_node: bool = False,
) -> JobSpec:
    """Three nodes, ``spares`` spares.  A job with a spare holds at step
    :data:`HOLD_AT` until the test writes ``tmp/go`` (:func:`spare_ready`).  Steps of
    0.3 s by default: slow enough for a test to kill a node within a window of steps.
    ``seed_by_node``: each node initialises its model apart (``--seed-by-node``)."""
    more = ["--hold-at", str(HOLD_AT), "--go-file", str(tmp / "go")] if spares else []
    more += ["--seed-by-node"] if seed_by_node else []
    base = tiny_job(
        name, tmp, steps=STEPS, step_time=step_time, spares=spares, extra_args=more
    ).to_dict()
    base["nodes"] = {"min": 3, "max": 3, "spares": spares}
    base["sync"] = sync
    return load_job_data(base)


class HandRun:
    """examples/train_tiny.py under a delayed sync, by hand in one process.

    Each site's DDP step is the mean of its ranks' gradients.  When a fragment's sync
    starts, each site's pseudo-gradient is taken (and encoded as it would travel:
    ``slices`` > 1 encodes each rank's rows of it apart, as an FSDP2 model in each site
    sends them); ``delay_steps`` later the sites' average (each weighs as its ranks)
    goes through the outer Nesterov step (the new anchor) and each site's fragment
    becomes ``alpha`` times itself (its inner steps since the start in it) plus
    ``1 - alpha`` times the anchor.
    """

    def __init__(
        self, sync: SyncSpec, sites: list[list[int]], seed: int = 0, slices: int = 1
    ) -> None:
        self.sync = sync
        self.slices = slices
        self.x, self.y = dataset()
        torch.manual_seed(seed)
        first = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        self.runs = cut_fragments([p.numel() for p in first.parameters()], sync.fragments)
        self._regroup(first, None, sites)
        self.anchors = [flatten(f) for f in self.frags[0]]
        self.bufs = [torch.zeros_like(a) for a in self.anchors]
        self.outer = OuterOptimizer.of_spec(sync.outer_optimizer)
        self.schedule = FragmentSchedule(sync.inner_steps, sync.fragments, sync.delay_steps)
        self.started: dict[int, list[tuple[float, torch.Tensor]]] = {}
        self.started_at: dict[int, int] = {}

    def _regroup(self, model: nn.Module, opt: Any, sites: list[list[int]]) -> None:
        self.sites = sites
        self.models = [model] + [copy.deepcopy(model) for _ in sites[1:]]
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in self.models]
        if opt is not None:
            for o in self.opts:
                o.load_state_dict(copy.deepcopy(opt.state_dict()))
        self.frags = [
            [[list(m.parameters())[i] for i in run] for run in self.runs] for m in self.models
        ]

    def train(self, start: int, end: int, lost_at: int | None = None) -> HandRun:
        """Steps ``start .. end - 1``.  ``lost_at``: the first site's only node is lost with
        ``lost_at`` steps complete and a spare takes its place: its parameters become the
        anchors (the global model), its optimizer the second site's, and a sync that
        starts there averages the other sites' pseudo-gradients only."""
        world = sum(len(s) for s in self.sites)
        for step in range(start, end):
            for model, opt, ranks in zip(self.models, self.opts, self.sites, strict=True):
                grads = []
                for r in ranks:
                    model.zero_grad()
                    xb, yb = batch(step, r, world, self.x, self.y)
                    loss = F.cross_entropy(model(xb), yb, reduction="sum") * world / GLOBAL_BATCH
                    loss.backward()
                    grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
                for i, p in enumerate(model.parameters()):
                    p.grad = sum(g[i] for g in grads) / len(ranks)  # type: ignore[assignment]
                opt.step()
            done = step + 1
            lost = done == lost_at
            f = self.schedule.starts_at(done)
            if f is not None:  # a lost site's pseudo-gradient does not count
                self.started_at[f] = done
                self.started[f] = [  # each site weighs as its ranks (its tokens)
                    (
                        0.0 if lost and i == 0 else float(len(self.sites[i])),
                        pseudo_gradient(self.anchors[f], s[f]),
                    )
                    for i, s in enumerate(self.frags)
                ]
            if lost:
                write_back(list(self.models[0].parameters()), torch.cat(self.anchors))
                self.opts[0].load_state_dict(copy.deepcopy(self.opts[1].state_dict()))
            f = self.schedule.applies_at(done)
            due = [f] if f is not None else []
            if done == STEPS:  # the run's end: every sync under way, in the order started
                due = sorted(self.started, key=lambda g: self.started_at[g])
            for f in due:
                self._apply(f)
            if done == STEPS:  # and it ends on the global model
                for site in self.frags:
                    for f, anchor in enumerate(self.anchors):
                        write_back(site[f], anchor)
        return self

    def _apply(self, f: int) -> None:
        mine = [g for _, g in self.started[f]]
        weights = [w for w, _ in self.started.pop(f)]
        sent = [self._travelled(g, f) for g in mine]
        avg = average(list(zip(weights, sent, strict=True)))
        self.outer.step(self.anchors[f], self.bufs[f], avg)
        alpha = self.sync.mixing
        for site in self.frags:
            local = flatten(site[f])  # with a delay, the steps since the start are in it
            write_back(site[f], alpha * local + (1 - alpha) * self.anchors[f])

    def _travelled(self, g: torch.Tensor, f: int) -> torch.Tensor:
        """Fragment ``f``'s pseudo-gradient ``g`` as the other sites decode it: encoded
        whole, or by slice (rank ``i`` of a site sends rows chunk ``i`` of each parameter
        of the fragment, in order, as one vector)."""
        kind = self.sync.quantization
        if self.slices == 1:
            return decode(encode(g, kind), kind, g.numel())
        shapes = [p.shape for p in self.frags[0][f]]
        pieces = g.split([s.numel() for s in shapes])
        whole = [t.view(s).clone() for t, s in zip(pieces, shapes, strict=True)]
        for i in range(self.slices):
            rows = [t.chunk(self.slices)[i] for t in whole]
            flat = torch.cat([r.reshape(-1) for r in rows])
            back = decode(encode(flat, kind), kind, flat.numel())
            for r, piece in zip(rows, back.split([r.numel() for r in rows]), strict=True):
                r.copy_(piece.view_as(r))
        return torch.cat([t.reshape(-1) for t in whole])

    def resume_as(self, sites: list[list[int]]) -> HandRun:
        """A durable resume on ``sites``: every site starts from the first site's state."""
        self._regroup(copy.deepcopy(self.models[0]), self.opts[0], sites)
        return self

    def final(self) -> dict[str, torch.Tensor]:
        """What rank 0 (the first site) saves at the end: the global model, after a run
        to :data:`STEPS`."""
        return {k: v.clone() for k, v in self.models[0].state_dict().items()}


def kill_in_site_b(spec: JobSpec, tmp: Path, lines: list[str]) -> tuple[Any, Any]:
    """Run ``spec`` (a :func:`diloco_job` with a spare, held at :data:`HOLD_AT`) with node-3
    as site b's warm spare, kill node-1 of site b once the spare is warm; the result and
    the job's last status."""
    run = quiet_run(spec, lines, node_labels=ZONES)
    # the spare starts once the job trains: the first generation holds both sites
    run.node_names = lambda: ["node-0", "node-1", "node-2"]  # type: ignore[method-assign]
    with run:
        wait_for_step(run, 0)
        run.add_node("node-3", rack="rack-1")
        spare_ready(run, "node-3", tmp / "go")
        run.kill_node("node-1")  # site b's: the spare (zone b too) takes its slot
        result = run.wait()
        return result, jobs.read_status(run.client, spec.name)


@pytest.mark.parametrize(
    "sync",
    [DILOCO, pytest.param(STREAMING, marks=pytest.mark.long)],  # streaming: test_diloco_fsdp
    ids=["diloco", "streaming"],
)
def test_hot_swap_in_a_site_ends_as_the_algorithm_by_hand(
    tmp_path: Path, sync: dict[str, object]
) -> None:
    lines: list[str] = []
    # every node initialises its model apart: the sites start from rank 0's (node-2's), as
    # DDP's first broadcast makes a job's replicas start alike (a site's DDP spans its site)
    spec = diloco_job("diloco-kill", tmp_path, 1, sync, step_time=0.1, seed_by_node=True)
    result, status = kill_in_site_b(spec, tmp_path, lines)
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries >= 1, summary(result, lines)
    assert_exactly_once(tmp_path, STEPS)
    # status: the outer loop's steps (fragments' syncs applied by rank 0) and bytes
    assert status is not None and status.sync, summary(result, lines)
    schedule = FragmentSchedule(10, spec.sync.fragments, spec.sync.delay_steps)
    applied = len(schedule.starts_between(0, STEPS))  # the end applies what it started
    assert applied - 1 <= status.sync["outer_steps"] <= applied, status.sync
    assert status.sync["site_bytes"] > 0, status.sync
    # sites [node-2] and [the two of zone b], as if nothing had failed
    hand = HandRun(spec.sync, [[0], [1, 2]], seed=2).train(0, STEPS).final()
    assert_same_params(torch.load(tmp_path / "final.pt"), hand)


def test_a_site_lost_whole_comes_back_from_the_global_parameters(tmp_path: Path) -> None:
    """Site a's only node dies; a spare of zone a takes its place with no state of the
    site left anywhere: it starts from the anchors (the sites' common parameters at the
    last outer step), with site b's optimizer state.  Every worker holds before
    :data:`HOLD_AT`, mid inner period, until node-2 is declared failed; site b then
    trains on until the sites meet."""
    lines: list[str] = []
    spec = diloco_job("diloco-site", tmp_path, 1, DILOCO, step_time=0.1)
    run = quiet_run(spec, lines, node_labels={**ZONES, "node-3": {"zone": "a"}})
    run.node_names = lambda: ["node-0", "node-1", "node-2"]  # type: ignore[method-assign]
    with run:
        wait_for_step(run, 0)
        run.add_node("node-3", rack="rack-1")
        wait_for_spare(run, "node-3")
        # mid inner period (every worker holds before step HOLD_AT): the site goes between
        # two outer syncs, and site b goes on only once the new generation is planned
        run.kill_node("node-2")
        wait_for("node-2 declared failed", lambda: "node-2" in _failed(run))
        (tmp_path / "go").touch()
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    back = [line for line in lines if "site a had no state" in line]
    assert back and back[0].startswith("[node-3]"), summary(result, lines)
    # site b leaves the generation at its next step (not at its next meeting with site a):
    # the spare starts from the anchors there, and the next sync averages both sites
    lost_at = int(back[0].rsplit("at step ", 1)[1])
    assert lost_at % 10 != 0, lost_at  # mid inner period, where site b was
    want = HandRun(spec.sync, [[0], [1, 2]]).train(0, STEPS, lost_at=lost_at).final()
    assert_same_params(torch.load(tmp_path / "final.pt"), want)


def _step(run: LocalRun) -> int:
    status = jobs.read_status(run.client, run.spec.name)
    return status.step if status is not None else 0


def _failed(run: LocalRun) -> list[str]:
    status = jobs.read_status(run.client, run.spec.name)
    return status.failed_nodes if status is not None else []


def test_a_diloco_checkpoint_resumes_on_another_world_size(tmp_path: Path) -> None:
    """Three nodes in two sites save at step 20 (after its outer step); two nodes, one
    per site, resume from it and train to step 40.  The checkpoint holds the first
    site's state and the outer state (anchors, momentum): every site of the resumed
    run starts from them, and the run ends as the algorithm by hand."""
    lines: list[str] = []
    first = diloco_job("diloco-save", tmp_path, 0, DILOCO, step_time=0.02).to_dict()
    first["max_steps"], first["checkpoint"]["every_steps"] = 20, 10
    with quiet_run(load_job_data(first), lines, node_labels=ZONES) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)

    second = {**first, "name": "diloco-resumed", "max_steps": STEPS}
    second["nodes"] = {"min": 2, "max": 2, "spares": 0}
    spec = load_job_data(second)
    resume = plan_resume(spec)
    assert (resume.step, resume.world_size) == (20, 3)
    sites = {"node-0": {"zone": "a"}, "node-1": {"zone": "b"}}
    with quiet_run(spec, lines, node_labels=sites, resume=resume) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert any("resumed from" in line and "at step 20" in line for line in lines)
    want = HandRun(spec.sync, [[0], [1, 2]]).train(0, 20).resume_as([[0], [1]]).train(20, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), want.final())


def test_a_site_lost_without_a_spare_rejoins_when_its_node_comes_back(tmp_path: Path) -> None:
    """No spare: site a's only node dies and the generation scales down to site b alone,
    which trains on and takes its outer steps alone.  The node's agent starts again (the
    machine is back): the generation scales up to ``nodes.max``, site a comes back from
    the global parameters, and the run ends with every step applied once and every outer
    step counted once."""
    lines: list[str] = []
    base = diloco_job("diloco-back", tmp_path, 0, DILOCO).to_dict()
    base["nodes"] = {"min": 2, "max": 3, "spares": 0}
    spec = load_job_data(base)
    with quiet_run(spec, lines, node_labels=ZONES) as run:
        wait_for("a step 2-4 past a sync", lambda: _step(run) % 10 in (2, 3, 4))
        run.kill_node("node-2")  # site a's only node
        lost = _step(run)
        # site b alone takes an outer step before the node is back
        wait_for("site b's outer step alone", lambda: _step(run) >= (lost // 10 + 1) * 10 + 2)
        run.add_node("node-2", rack="rack-1")
        result = run.wait()
        status = jobs.read_status(run.client, spec.name)
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    types = [e.type for e in result.events]
    assert "ScaledUp" in types, types
    up = next(e for e in result.events if e.type == "ScaledUp")
    assert up.data["nodes"] == ["node-2"], up
    back = [line for line in lines if "site a had no state" in line]
    assert back and back[-1].startswith("[node-2]"), summary(result, lines)
    assert_exactly_once(tmp_path, STEPS)
    assert status is not None and status.active_nodes == ["node-0", "node-1", "node-2"], status
    schedule = FragmentSchedule(10, spec.sync.fragments, spec.sync.delay_steps)
    applied = len(schedule.starts_between(0, STEPS))
    assert applied - 1 <= status.sync["outer_steps"] <= applied, status.sync
