"""The outer step as the papers define it, run by :class:`OuterSync` in a real gloo group.

One rank, one site (the round goes through the generation's real store, with one
offer): each fragment's sync sends the site's pseudo-gradient encoded as the
spec resolves it, the outer Nesterov step moves the fragment's anchor (the
global fragment), and the fragment's parameters become ``alpha * local + (1 -
alpha) * global``, where ``local`` holds the steps taken while the sync was
under way.  Each fragment keeps its own momentum and count of outer steps: one
fragment's outer step leaves the other's state as it was.  Everything is
checked against the same algorithm computed here step by step.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from agents.sync.outer_step import flatten
from agents.sync.outer_sync import OuterSync
from agents.sync.quantize import decode, encode
from agents.sync.schedule import FragmentSchedule
from agents.sync.site_groups import form_site_groups
from agents.sync.sites import Sites
from orchestrator.spec.loader import load_job_data
from orchestrator.spec.sync import OuterQuantization, SyncSpec

pytestmark = pytest.mark.unit

SIZES = (300, 200)  # two parameters, one per fragment; the first spans two blocks
STEPS = 12


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _spec(sync: dict[str, object]) -> SyncSpec:
    job = load_job_data({"name": "mix", "entrypoint": {"script": "t.py"}, "sync": sync})
    return job.sync


def _move(step: int) -> list[torch.Tensor]:
    """What inner step ``step`` subtracts from each parameter: known, different each step,
    of magnitudes spread over decades (as pseudo-gradients are)."""
    out = []
    for k, n in enumerate(SIZES):
        phase = torch.arange(n, dtype=torch.float32) * (k + 1) + step
        out.append(0.01 * torch.sin(phase) * torch.exp(-torch.arange(n) / 40.0))
    return out


def _initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in SIZES]


class _ByHand:
    """The algorithm, fragment by fragment (each fragment here is one parameter)."""

    def __init__(self, spec: SyncSpec) -> None:
        self.spec = spec
        self.schedule = FragmentSchedule(spec.inner_steps, spec.fragments, spec.delay_steps)
        self.params = _initial()
        self.anchors = [p.clone() for p in self.params]
        self.bufs = [torch.zeros(n) for n in SIZES]
        self.counts = [0] * len(SIZES)
        self.sent: dict[int, torch.Tensor] = {}

    def step(self, step: int) -> None:
        for p, d in zip(self.params, _move(step), strict=True):
            p.sub_(d)
        done = step + 1
        started = self.schedule.starts_at(done)
        if started is not None:
            g = self.anchors[started] - self.params[started]
            kind = self.spec.quantization
            self.sent[started] = decode(encode(g, kind), kind, g.numel())
        applied = self.schedule.applies_at(done)
        if applied is not None:
            g = self.sent.pop(applied)
            lr, momentum = self.spec.outer_optimizer.lr, self.spec.outer_optimizer.momentum
            self.bufs[applied] = momentum * self.bufs[applied] + g
            self.anchors[applied] = self.anchors[applied] - lr * (g + momentum * self.bufs[applied])
            alpha = self.spec.mixing
            local = self.params[applied]  # its steps since the sync started are in it
            self.params[applied] = alpha * local + (1 - alpha) * self.anchors[applied]
            self.counts[applied] += 1


def _run(spec: SyncSpec) -> list[tuple[list[torch.Tensor], list[torch.Tensor], list[int]]]:
    """OuterSync on real parameters: after each step, (parameters, momentum, counts)."""
    params = [torch.nn.Parameter(p) for p in _initial()]
    outer = OuterSync(spec, params)
    sites = Sites(("a",), ((0,),))
    outer.groups = form_site_groups(sites, 0, torch.device("cpu"), timedelta(seconds=30))
    assert outer.runs == [[0], [1]]
    seen = []
    for step in range(STEPS):
        with torch.no_grad():
            for p, d in zip(params, _move(step), strict=True):
                p.sub_(d)
        outer.after_step(step + 1)
        seen.append(
            (
                [p.detach().clone() for p in params],
                [m.clone() for m in outer.momentum],
                list(outer.counts),
            )
        )
    return seen


@pytest.mark.parametrize(
    ("sync", "quantization", "alpha"),
    [
        # the papers' defaults: 4-bit floats, half of the site's own fragment kept
        (
            {"mode": "streaming_diloco", "inner_steps": 4, "fragments": 2, "delay_steps": 1},
            OuterQuantization.E3M0,
            0.5,
        ),
        # written: the uniform 4-bit integers, a quarter kept, no delay
        (
            {
                "mode": "streaming_diloco",
                "inner_steps": 4,
                "fragments": 2,
                "outer_quantization": "4bit",
                "alpha": 0.25,
            },
            OuterQuantization.INT4,
            0.25,
        ),
    ],
    ids=["papers-defaults", "written"],
)
def test_a_fragment_merges_the_global_one_with_its_own_steps(
    one_rank: None, sync: dict[str, object], quantization: OuterQuantization, alpha: float
) -> None:
    spec = _spec(sync)
    assert spec.quantization is quantization and spec.mixing == alpha
    hand = _ByHand(spec)
    seen = _run(spec)
    for step, (params, momentum, counts) in enumerate(seen):
        hand.step(step)
        for got, want in zip(params, hand.params, strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), step
        for got, want in zip(momentum, hand.bufs, strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), step
        assert counts == hand.counts, step
    # the merge kept a share of each site's own fragment: its parameters are not the
    # global fragment (the anchor), which the next pseudo-gradient counts from
    assert min(hand.counts) >= 2  # each fragment took outer steps with momentum
    assert not torch.allclose(seen[-1][0][0], hand.anchors[0])


def test_diloco_takes_the_global_fragment_whole(one_rank: None) -> None:
    """DiLoCo's alpha is 0: after an outer step the parameters are the anchor, also with a
    delay (the steps taken while the sync travelled are replaced, as the paper's merge
    at alpha 0 does)."""
    spec = _spec({"mode": "diloco", "inner_steps": 3, "delay_steps": 1})
    assert spec.mixing == 0.0 and spec.quantization is OuterQuantization.NONE
    params = [torch.nn.Parameter(p) for p in _initial()]
    outer = OuterSync(spec, params)
    outer.groups = form_site_groups(
        Sites(("a",), ((0,),)), 0, torch.device("cpu"), timedelta(seconds=30)
    )
    for step in range(4):
        with torch.no_grad():
            for p, d in zip(params, _move(step), strict=True):
                p.sub_(d)
        outer.after_step(step + 1)
    assert outer.counts == [1]  # started at 3, applied at 4
    assert torch.equal(flatten(params), outer.anchors[0])


def test_each_fragment_has_its_own_outer_momentum_and_count(one_rank: None) -> None:
    """Fragment 0 syncs at steps 2, 6, 10 and fragment 1 at 4, 8, 12 (results a step
    later).  An outer step of one fragment changes its own momentum and count only: the
    other's stay as they were, zero before its first."""
    spec = _spec({"mode": "streaming_diloco", "inner_steps": 4, "fragments": 2, "delay_steps": 1})
    seen = _run(spec)
    counts = [c for _, _, c in seen]
    assert counts[2] == [1, 0] and counts[4] == [1, 1] and counts[6] == [2, 1]
    momentum = [m for _, m, _ in seen]
    assert momentum[2][0].abs().sum() > 0 and not momentum[2][1].any()
    assert torch.equal(momentum[4][0], momentum[2][0])  # fragment 1's step left 0's alone
    assert momentum[4][1].abs().sum() > 0
    assert not torch.equal(momentum[6][0], momentum[4][0])  # fragment 0's second step
    assert torch.equal(momentum[6][1], momentum[4][1])  # and it left 1's alone
