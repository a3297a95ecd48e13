"""Compressors, safety verdicts and node layouts, in process (no process group)."""

from __future__ import annotations

import pytest
import torch

from agents.comm.api import CommConfigError, NodeLayout, StepMetrics
from agents.comm.qsgd import CHUNK, QSGDCompressor
from agents.comm.safety import NormTracker, SafetyPolicy, Verdict
from agents.comm.topk import TopKCompressor
from orchestrator.topology import NodeInfo, topology_order

pytestmark = pytest.mark.unit


def _zeros(names: tuple[str, ...], n: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(n) for k in names}


def test_topk_sends_largest_and_keeps_the_rest_as_residual() -> None:
    comp = TopKCompressor(ratio=0.1)
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    enc = comp.encode(grad, _zeros(comp.buffer_names, 1000), 0, torch.Generator())
    assert enc.payload.numel() == 2 * 100
    decoded = comp.decode_sum(enc.payload[None, :], 1000, 0)
    sent = decoded != 0
    assert int(sent.sum()) == 100
    assert grad.abs()[sent].min() >= grad.abs()[~sent].max()
    # Nothing is lost: what was sent plus what is kept is the corrected gradient.
    assert torch.allclose(decoded + enc.commit["residual"], grad)


def test_topk_decode_sums_every_rank() -> None:
    comp = TopKCompressor(ratio=0.5)
    a = torch.tensor([1.0, 0.0, 3.0, 0.0])
    b = torch.tensor([0.0, 2.0, 3.0, 0.0])
    pa = comp.encode(a, _zeros(comp.buffer_names, 4), 0, torch.Generator()).payload
    pb = comp.encode(b, _zeros(comp.buffer_names, 4), 0, torch.Generator()).payload
    assert comp.decode_sum(torch.stack([pa, pb]), 4, 0).tolist() == [1.0, 2.0, 6.0, 0.0]


def test_topk_momentum_correction_masks_sent_momentum() -> None:
    comp = TopKCompressor(ratio=0.25, momentum=0.9)
    bufs = {"momentum": torch.tensor([1.0, 1.0, 1.0, 1.0]), "residual": torch.zeros(4)}
    grad = torch.tensor([10.0, 0.0, 0.0, 0.0])
    enc = comp.encode(grad, bufs, 0, torch.Generator())
    # u = 0.9·u + g = [10.9, .9, .9, .9]; v = u; element 0 is sent and cleared in u and v.
    assert enc.commit["momentum"].tolist() == pytest.approx([0.0, 0.9, 0.9, 0.9])
    assert enc.commit["residual"].tolist() == pytest.approx([0.0, 0.9, 0.9, 0.9])
    assert bufs["momentum"].tolist() == [1.0, 1.0, 1.0, 1.0]  # encode does not mutate
    send, after = comp.dense(grad, bufs)
    assert send.tolist() == pytest.approx([10.9, 0.9, 0.9, 0.9])
    assert after["residual"].abs().sum() == 0


def test_topk_warmup_density_falls_to_ratio_and_goes_dense_when_cheaper() -> None:
    comp = TopKCompressor(ratio=0.01, warmup_steps=10)
    densities = [comp.density(s) for s in range(12)]
    assert densities == sorted(densities, reverse=True)
    assert densities[0] < 1.0 and densities[-1] == 0.01
    assert not comp.active(0, 10_000, world_size=4)  # 66% density: dense is cheaper
    assert comp.active(10, 10_000, world_size=4)


@pytest.mark.parametrize("bits", [8, 4])
def test_qsgd_round_trip_is_unbiased_and_bounded(bits: int) -> None:
    comp = QSGDCompressor(bits)
    n = 2 * CHUNK + 37
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    mean = torch.zeros(n)
    trials = 200
    for _ in range(trials):
        enc = comp.encode(x, _zeros(comp.buffer_names, n), 0, gen)
        assert enc.payload.dtype == torch.uint8
        assert enc.payload.numel() == comp.payload_bytes(n)
        decoded = comp.decode_sum(enc.payload[None, :], n, 0)
        step = x.abs().max() / comp.levels
        assert (decoded - x).abs().max() <= step + 1e-5
        assert torch.allclose(decoded + enc.commit["residual"], x, atol=1e-5)
        mean += decoded / trials
    assert (mean - x).abs().mean() < 0.05 * x.abs().mean()


def test_qsgd_four_bit_payload_is_half_of_eight_bit() -> None:
    assert QSGDCompressor(4).code_bytes(1001) == 501
    assert QSGDCompressor(8).code_bytes(1001) == 1001


def test_safety_policy_dense_steps() -> None:
    policy = SafetyPolicy(warmup_steps=3, dense_sync_every=4)
    dense = [s for s in range(12) if policy.dense_step(s)]
    assert dense == [0, 1, 2, 6, 10]


def test_norm_tracker_verdicts() -> None:
    policy = SafetyPolicy(explode_factor=10.0, min_history=3)
    tracker = NormTracker()
    for _ in range(3):
        assert tracker.verdict("b", [1.0, 1.2], policy) is Verdict.USE
    assert tracker.verdict("b", [1.0, float("nan")], policy) is Verdict.NON_FINITE
    assert tracker.verdict("b", [1.0, float("inf")], policy) is Verdict.NON_FINITE
    assert tracker.verdict("b", [1.0, 500.0], policy) is Verdict.EXPLODING
    assert tracker.verdict("b", [1.5, 1.1], policy) is Verdict.USE
    restored = NormTracker()
    restored.load_state_dict(tracker.state_dict())
    assert restored.verdict("b", [1.0, 500.0], policy) is Verdict.EXPLODING
    assert restored.count == {"b": 4}


def test_node_layout_groups() -> None:
    layout = NodeLayout.uniform(6, 3)
    assert layout.nodes == [[0, 1, 2], [3, 4, 5]]
    assert layout.peers_by_local_rank() == [[0, 3], [1, 4], [2, 5]]
    assert layout.local_rank_of(4) == 1
    assert NodeLayout.from_env(4, {"LOCAL_WORLD_SIZE": "2"}).nodes == [[0, 1], [2, 3]]
    order = topology_order(
        [NodeInfo(f"n{i}", 2, {"rack": f"r{i % 2}"}) for i in range(3)], label_names=["rack"]
    )
    from_order = NodeLayout.from_node_ranks(s.node_rank for s in order.slots)
    assert from_order.nodes == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(CommConfigError, match="not a multiple"):
        NodeLayout.uniform(5, 2)
    with pytest.raises(CommConfigError, match="different numbers"):
        _ = NodeLayout((0, 0, 1)).local_world_size


def test_step_metrics_ratios() -> None:
    m = StepMetrics(numel=1000, wire_bytes=80)
    assert m.ratio_vs_fp32 == 50.0
    assert m.ratio_vs_fp16 == 25.0
    assert m.as_dict()["ratio_vs_fp32"] == 50.0
