"""The outer loop per slice (FSDP2 in each site) against the algorithm by hand.

Four real gloo processes form two sites of two ranks; rank ``i`` of each site
holds rows chunk ``i`` of every parameter (as ``fully_shard`` cuts them) and
runs :class:`~agents.sync.outer_sync.OuterSync` on those rows only, on the
groups of ``form_site_groups(..., per_slice=True)``: Streaming DiLoCo with two
fragments (cut by the whole parameters), a delay of two steps, and the paper's
defaults: 4-bit float (E3M0) pseudo-gradients, each site's fragment merged half
and half with the global one.  The inner steps are replaced by known moves of
each site's parameters.  The hand computation runs the same algorithm on each
slice (quantised per slice, as it travels), and the slices assemble into the
parameters it ends with, the same on both sites.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from agents.sync.outer_step import OuterOptimizer, average, flatten, pseudo_gradient, write_back
from agents.sync.quantize import decode, encode
from agents.sync.schedule import FragmentSchedule, cut_fragments
from orchestrator.spec.sync import OuterQuantization, SyncSpec
from tests.gloo import run_gloo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SHAPES = [(6, 5), (6,), (3, 2)]
SLICES = 2
END = 20
#: at the paper's defaults: e3m0 pseudo-gradients, alpha 0.5
SYNC = {"mode": "streaming_diloco", "inner_steps": 8, "fragments": 2, "delay_steps": 2}


def _spec() -> SyncSpec:
    from orchestrator.spec.loader import load_job_data

    job = load_job_data(
        {
            "name": "slices",
            "entrypoint": {"script": "x.py"},
            "sync": SYNC,
        }
    )
    return job.sync


def _initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _move(site: int, step: int) -> list[torch.Tensor]:
    """What site ``site``'s inner step ``step`` subtracts from the whole parameters."""
    out = []
    for k, shape in enumerate(SHAPES):
        n = torch.Size(shape).numel()
        phase = torch.arange(n, dtype=torch.float32) * (k + 1) + step
        out.append(0.01 * (site + 1) * torch.sin(phase).view(shape))
    return out


def _chunks(params: list[torch.Tensor], index: int) -> list[torch.Tensor]:
    return [p.chunk(SLICES)[index] for p in params]


def _site_rank(rank: int, world: int) -> list[float]:
    from agents.sync.outer_sync import OuterSync
    from agents.sync.site_groups import form_site_groups
    from agents.sync.sites import Sites

    sites = Sites(("a", "b"), ((0, 1), (2, 3)))
    site, index = divmod(rank, SLICES)
    full = _initial()
    rows = _chunks(full, index)  # views: this rank's slice of the whole parameters
    outer = OuterSync(_spec(), full, local=lambda: rows)
    outer.end = END
    groups = form_site_groups(sites, rank, torch.device("cpu"), timedelta(seconds=60), True)
    outer.groups = groups
    outer.fit()
    outer.anchor_to_parameters(0)
    for step in range(END):
        with torch.no_grad():
            for p, d in zip(rows, _chunks(_move(site, step), index), strict=True):
                p.sub_(d)
        outer.after_step(step + 1)
    return [float(v) for v in flatten(rows)]


def _by_hand(spec: SyncSpec) -> list[list[torch.Tensor]]:
    """Per site, the whole parameters at the end: each slice runs the algorithm alone."""
    schedule = FragmentSchedule(spec.inner_steps, spec.fragments, spec.delay_steps)
    runs = cut_fragments([torch.Size(s).numel() for s in SHAPES], spec.fragments)
    opt = OuterOptimizer.of_spec(spec.outer_optimizer)
    kind, alpha = spec.quantization, spec.mixing
    sites = [_initial(), _initial()]

    def frag(site: int, index: int, f: int) -> list[torch.Tensor]:
        rows = _chunks(sites[site], index)
        return [rows[i] for i in runs[f]]

    anchors = {(i, f): flatten(frag(0, i, f)) for i in range(SLICES) for f in range(len(runs))}
    bufs = {k: torch.zeros_like(a) for k, a in anchors.items()}
    started: dict[int, int] = {}
    sent: dict[tuple[int, int], list[torch.Tensor]] = {}
    for step in range(END):
        for s, params in enumerate(sites):
            for p, d in zip(params, _move(s, step), strict=True):
                p.sub_(d)
        done = step + 1
        f = schedule.starts_at(done)
        if f is not None:
            started[f] = done
            for i in range(SLICES):
                sent[(i, f)] = [pseudo_gradient(anchors[(i, f)], frag(s, i, f)) for s in (0, 1)]
        due = [f] if (f := schedule.applies_at(done)) is not None and f in started else []
        if done == END:
            due = sorted(started, key=lambda g: started[g])
        for f in due:
            del started[f]
            for i in range(SLICES):
                mine = sent.pop((i, f))
                n = anchors[(i, f)].numel()
                avg = average([(1.0, decode(encode(g, kind), kind, n)) for g in mine])
                opt.step(anchors[(i, f)], bufs[(i, f)], avg)
                for s in (0, 1):  # each site's own slice: its steps since the start in it
                    local = flatten(frag(s, i, f))
                    write_back(frag(s, i, f), alpha * local + (1 - alpha) * anchors[(i, f)])
        if done == END:
            for s in (0, 1):
                for (i, f), a in anchors.items():
                    write_back(frag(s, i, f), a)
    return sites


def test_each_slice_syncs_with_its_twins_as_the_algorithm_by_hand() -> None:
    spec = _spec()
    assert spec.quantization is OuterQuantization.E3M0 and spec.mixing == 0.5
    got: list[Any] = run_gloo(_site_rank, 4)
    want = _by_hand(spec)
    for rank, values in enumerate(got):
        site, index = divmod(rank, SLICES)
        expected = flatten(_chunks(want[site], index))
        assert torch.allclose(torch.tensor(values), expected, rtol=1e-5, atol=1e-6), rank
    # the run ends on the global model: slice i is the same on both sites
    assert got[0] == got[2] and got[1] == got[3]
    # and it moved: each slice differs from where it started
    assert not torch.allclose(torch.tensor(got[0]), flatten(_chunks(_initial(), 0)))


def _resharded_rank(rank: int, world: int) -> tuple[Any, str]:
    """A resume on sites of one rank each, twice: this rank given the part its rank
    number wrote on two sites of two ranks (the whole parameters' anchors and momentum
    after the cut), then on two sites of three (the refusal's message)."""
    from types import SimpleNamespace

    from agents.api import StorageFaultError
    from agents.recovery.outer_reshard import reshard_from_checkpoint
    from agents.sync.outer_sync import OuterSync

    full = _initial()
    names = [f"p{i}" for i in range(len(full))]
    model = SimpleNamespace(
        rows={n: p.shape[0] for n, p in zip(names, full, strict=True)},
        params=dict(zip(names, full, strict=True)),
    )
    groups = SimpleNamespace(sites=SimpleNamespace(ranks=[[0], [1]]), index=rank)
    part = _chunks(full, rank)  # slice `rank` of the first saved site's
    saver = OuterSync(_spec(), full, local=lambda: part)
    saver.momentum = [2 * a + 1 for a in saver.anchors]  # a momentum of its own per value
    outer = OuterSync(_spec(), full, local=lambda: full)
    outer.saved_piece = {"sites": [[0, 1], [2, 3]], "state": saver.state_dict()}
    reshard_from_checkpoint(outer, model, groups, None)  # type: ignore[arg-type]
    cut = [[float(v) for v in t] for t in (*outer.anchors, *outer.momentum)]
    # rank 2's part is beyond a world of 2 (refused before any part is used)
    outer.saved_piece = {"sites": [[0, 1, 2], [3, 4, 5]], "state": saver.state_dict()}
    try:
        reshard_from_checkpoint(outer, model, groups, None)  # type: ignore[arg-type]
    except StorageFaultError as e:
        return cut, str(e)
    return cut, "not refused"


def test_a_slices_outer_state_is_cut_anew_over_real_collectives() -> None:
    """Saved on two sites of two ranks, resumed on two sites of one: ranks 0 and 1 hold
    the first saved site's parts and both get the whole anchors and momentum; saved on
    sites of three ranks, the resume on two is refused, naming the ranks."""
    got: list[Any] = run_gloo(_resharded_rank, 2)
    whole = _whole_anchors()
    want = [[float(v) for v in t] for t in (*whole, *[2 * a + 1 for a in whole])]
    assert [cut for cut, _ in got] == [want, want]
    for _, message in got:
        assert "in the parts of ranks [0, 1, 2] (its first site)" in message, message
        assert "this generation has 2 ranks: resume on at least 3 ranks" in message, message


def _whole_anchors() -> list[torch.Tensor]:
    """The anchors of the whole parameters (every fragment's), as a fresh loop has them."""
    from agents.sync.outer_sync import OuterSync

    return OuterSync(_spec(), _initial()).anchors
