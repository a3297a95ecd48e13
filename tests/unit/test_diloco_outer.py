"""DiLoCo's pure parts: the fragment schedule, the outer step against a hand
computation, pseudo-gradient encodings, sites, the outer state and the job file."""

from __future__ import annotations

import pytest
import torch

from agents.sync.outer_step import OuterOptimizer, average, pseudo_gradient, write_back
from agents.sync.outer_sync import NOT_PENDING, OuterSync
from agents.sync.quantize import decode, empty_like_payload, encode, payload_bytes
from agents.sync.schedule import FragmentSchedule, cut_fragments
from agents.sync.sites import Sites
from orchestrator.controller.placement import spares_by_site, spread_spares
from orchestrator.local_run import node_labels_from
from orchestrator.spec.api import SpecError
from orchestrator.spec.loader import load_job_data
from orchestrator.spec.sync import OuterQuantization, SyncMode, SyncSpec
from orchestrator.state.records import Member, Plan
from orchestrator.topology import NodeInfo

pytestmark = pytest.mark.unit


# -- schedule ------------------------------------------------------------------------------


def test_diloco_syncs_the_whole_model_every_inner_steps() -> None:
    s = FragmentSchedule(inner_steps=5)
    assert [d for d in range(0, 21) if s.starts_at(d) is not None] == [5, 10, 15, 20]
    assert all(s.starts_at(d) in (None, 0) for d in range(30))
    assert s.applies_at(5) == 0 and s.applies_at(6) is None


def test_streaming_fragments_start_staggered_and_apply_after_the_delay() -> None:
    s = FragmentSchedule(inner_steps=12, fragments=3, delay_steps=2)
    starts = {d: s.starts_at(d) for d in range(1, 30) if s.starts_at(d) is not None}
    # fragment f at (f + 1) * H / F, then every H: one fragment on the wire at a time
    assert starts == {4: 0, 8: 1, 12: 2, 16: 0, 20: 1, 24: 2, 28: 0}
    applies = {d: s.applies_at(d) for d in range(1, 30) if s.applies_at(d) is not None}
    assert applies == {d + 2: f for d, f in starts.items() if d + 2 < 30}
    assert s.starts_between(4, 16) == [(8, 1), (12, 2), (16, 0)]
    assert s.starts_between(0, 3) == []


def test_a_schedule_that_cannot_stagger_is_refused() -> None:
    with pytest.raises(ValueError):
        FragmentSchedule(inner_steps=10, fragments=3)
    with pytest.raises(ValueError):
        FragmentSchedule(inner_steps=12, fragments=3, delay_steps=4)


def test_fragments_are_contiguous_balanced_and_never_empty() -> None:
    assert cut_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert cut_fragments([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert cut_fragments([1, 1, 1, 100], 3) == [[0, 1], [2], [3]]
    runs = cut_fragments([7, 3, 12, 5, 9, 1, 4, 8], 4)
    assert [i for run in runs for i in run] == list(range(8)) and all(runs)
    with pytest.raises(ValueError, match="at most 2 fragments"):
        cut_fragments([5, 5], 3)


# -- the outer step ------------------------------------------------------------------------


def test_outer_nesterov_step_matches_a_hand_computation() -> None:
    anchor = torch.tensor([1.0, 2.0])
    site_a = [torch.nn.Parameter(torch.tensor([0.5, 2.5]))]
    g_a = pseudo_gradient(anchor, site_a)
    assert g_a.tolist() == [0.5, -0.5]
    g_b = torch.tensor([0.1, 0.1])
    avg = average([(1.0, g_a), (1.0, g_b)])
    assert torch.allclose(avg, torch.tensor([0.3, -0.2]))
    buf = torch.zeros(2)
    opt = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    opt.step(anchor, buf, avg)
    # buf = g; update = g + 0.9 * buf = 1.9 g; anchor -= 0.7 * update
    assert torch.allclose(buf, torch.tensor([0.3, -0.2]))
    assert torch.allclose(anchor, torch.tensor([1.0 - 0.7 * 0.57, 2.0 + 0.7 * 0.38]))
    second = torch.tensor([0.1, 0.0])
    before = anchor.clone()
    opt.step(anchor, buf, second)
    # buf = 0.9 * [0.3, -0.2] + [0.1, 0] = [0.37, -0.18]; update = g + 0.9 buf
    assert torch.allclose(buf, torch.tensor([0.37, -0.18]))
    want = before - 0.7 * (second + 0.9 * torch.tensor([0.37, -0.18]))
    assert torch.allclose(anchor, want)


def test_plain_sgd_with_lr_one_is_averaging() -> None:
    anchor = torch.tensor([1.0, 1.0])
    OuterOptimizer(lr=1.0, momentum=0.0, nesterov=False).step(
        anchor, torch.zeros(2), torch.tensor([0.25, -0.5])
    )
    assert anchor.tolist() == [0.75, 1.5]  # the sites' mean of their parameters


def test_a_site_with_weight_zero_adds_nothing() -> None:
    avg = average([(1.0, torch.tensor([2.0])), (0.0, torch.tensor([100.0]))])
    assert avg.tolist() == [2.0]
    with pytest.raises(ValueError):
        average([(0.0, torch.tensor([1.0]))])


def test_write_back_fills_parameters_in_order_and_dtype() -> None:
    params = [torch.zeros(2, 2), torch.zeros(3, dtype=torch.bfloat16)]
    write_back(params, torch.arange(7, dtype=torch.float32))
    assert params[0].tolist() == [[0, 1], [2, 3]] and params[1].tolist() == [4, 5, 6]


# -- encodings -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(OuterQuantization))
def test_encodings_round_trip_within_their_step(kind: OuterQuantization) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g) * 0.01
    payload = encode(x, kind)
    assert sum(t.numel() * t.element_size() for t in payload) == payload_bytes(1000, kind)
    buffers = empty_like_payload(1000, kind)
    assert [(b.shape, b.dtype) for b in buffers] == [(p.shape, p.dtype) for p in payload]
    y = decode(payload, kind, 1000)
    # half a step of each form, of the block's largest value (e3m0: between 1/2 and 1)
    bound = {"none": 0.0, "bf16": 2**-8, "8bit": 0.5 / 127, "4bit": 0.5 / 7, "e3m0": 0.25}
    bound = bound[kind.value]
    assert (x - y).abs().max() <= bound * x.abs().max() + 1e-12
    assert torch.equal(decode(payload, kind, 1000), y)  # every site decodes the same bits


def test_four_bits_cost_an_eighth_of_float32_and_the_scales() -> None:
    n = 1 << 20
    assert payload_bytes(n, OuterQuantization.NONE) / payload_bytes(n, OuterQuantization.INT4) > 7.7
    assert payload_bytes(n, OuterQuantization.E3M0) == payload_bytes(n, OuterQuantization.INT4)


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 3 * 256])
def test_e3m0_payload_is_half_a_byte_a_value_and_a_scale_a_block(numel: int) -> None:
    kind = OuterQuantization.E3M0
    x = torch.linspace(-1.0, 1.0, numel)
    payload = encode(x, kind)
    blocks = -(-numel // 256)
    assert [(t.dtype, t.numel()) for t in payload] == [
        (torch.uint8, blocks * 128),
        (torch.float32, blocks),
    ]
    assert sum(t.numel() * t.element_size() for t in payload) == payload_bytes(numel, kind)
    assert payload_bytes(numel, kind) == blocks * (128 + 4)
    assert decode(payload, kind, numel).numel() == numel


def _e3m0_values(scale: float) -> list[float]:
    """Every value e3m0 represents in a block whose largest magnitude is ``scale``."""
    magnitudes = [0.0] + [scale * 2.0**-k for k in range(7)]
    return magnitudes + [-m for m in magnitudes[1:]]


def test_e3m0_gives_back_every_value_it_represents_exactly() -> None:
    """A sign, 3 exponent bits, no mantissa: 0 and the block's largest magnitude times
    2**0 .. 2**-6, of either sign.  Two blocks of other scales, each value exact."""
    kind = OuterQuantization.E3M0
    first = torch.tensor(_e3m0_values(0.0123) * 17)[:256]  # fills a block
    second = torch.tensor(_e3m0_values(-3.5e-5))  # the largest of this block is 3.5e-5
    x = torch.cat([first, second])
    y = decode(encode(x, kind), kind, x.numel())
    assert torch.equal(y, x)


def test_e3m0_rounds_each_value_to_the_nearest_level_on_the_number_line() -> None:
    """Against a brute force over the levels: the nearest by absolute difference; a tie
    goes to the larger magnitude; and the sign is kept."""
    kind = OuterQuantization.E3M0
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g) * torch.rand(4096, generator=g) ** 4
    y = decode(encode(x, kind), kind, x.numel())
    for block in range(x.numel() // 256):
        xs = x[block * 256 : (block + 1) * 256]
        levels = torch.tensor(_e3m0_values(float(xs.abs().max())))
        distance = (xs[:, None] - levels[None, :]).abs()
        best = distance.min(dim=1).values
        got = y[block * 256 : (block + 1) * 256]
        assert torch.equal((xs - got).abs(), best)  # no level is nearer
    # ties, relative to a largest magnitude of 1: halfway goes up; below 2**-7 goes to 0
    x = torch.tensor([1.0, 0.75, 0.7499, -0.375, -0.3749, 2.0**-7, 0.99 * 2.0**-7, 3 * 2.0**-8])
    y = decode(encode(x, kind), kind, x.numel())
    assert y.tolist() == [1.0, 1.0, 0.5, -0.5, -0.25, 2.0**-6, 0.0, 2.0**-6]


def test_e3m0_keeps_zero_and_blocks_of_zeros() -> None:
    """Zero is a level; a block of zeros has a scale of 0 and decodes to zeros (no
    division by its scale), and a tiny value beside a large one goes to 0."""
    kind = OuterQuantization.E3M0
    x = torch.zeros(600)
    x[300], x[301] = 1.0, 1e-4
    payload = encode(x, kind)
    assert payload[1].tolist() == [0.0, 1.0, 0.0]
    y = decode(payload, kind, 600)
    assert not torch.isnan(y).any()
    assert y[300] == 1.0 and y[301] == 0.0 and int((y != 0).sum()) == 1


@pytest.mark.parametrize("kind", [OuterQuantization.E3M0, OuterQuantization.INT4])
def test_four_bit_codes_are_the_same_every_time(kind: OuterQuantization) -> None:
    """Every site decodes every site's payload: encoding the same values twice gives the
    same bytes, and a payload received into fresh buffers decodes to the same bits."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10_000, generator=g) * 1e-3
    first, again = encode(x, kind), encode(x.clone(), kind)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    received = empty_like_payload(x.numel(), kind)
    for buffer, part in zip(received, first, strict=True):
        buffer.copy_(part)
    assert torch.equal(decode(received, kind, x.numel()), decode(first, kind, x.numel()))


# -- sites ---------------------------------------------------------------------------------


def _plan(*nodes: tuple[str, int, dict[str, str]]) -> Plan:
    members, base = [], 0
    for node, nproc, labels in nodes:
        members.append(Member(node=node, rank_base=base, nproc=nproc, labels=labels))
        base += nproc
    return Plan(generation=1, members=members)


def test_sites_are_the_nodes_that_share_the_label() -> None:
    plan = _plan(
        ("n0", 2, {"zone": "a"}), ("n1", 1, {"zone": "a"}), ("n2", 2, {"zone": "b"}), ("n3", 1, {})
    )
    sites = Sites.of_plan(plan, "zone")
    assert sites.names == ("a", "b", "node:n3")
    assert sites.ranks == ((0, 1, 2), (3, 4), (5,))
    assert sites.leaders == (0, 3, 5)
    assert [sites.index_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 2]
    with pytest.raises(ValueError):
        sites.index_of(9)


# -- the outer state -----------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_outer_state_round_trips_and_re_cuts_to_other_fragments() -> None:
    spec = SyncSpec(mode=SyncMode.STREAMING_DILOCO, inner_steps=8, fragments=4, delay_steps=1)
    model = _model()
    outer = OuterSync(spec, list(model.parameters()))
    outer.anchors = [a + i for i, a in enumerate(outer.anchors)]
    outer.momentum = [m + 0.5 for m in outer.momentum]
    outer.counts = [3, 3, 2, 2]
    outer.started = 10
    outer.pending_at[1] = 9
    state = outer.state_dict()

    same = OuterSync(spec, list(_model().parameters()))
    same.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(same.anchors, outer.anchors, strict=True))
    assert same.counts == [3, 3, 2, 2] and same.started == 10 and same.pending_at[1] == 9

    two = SyncSpec(mode=SyncMode.STREAMING_DILOCO, inner_steps=8, fragments=2)
    recut = OuterSync(two, list(_model().parameters()))
    recut.load_state_dict(state)
    assert torch.equal(torch.cat(recut.anchors), torch.cat(outer.anchors))
    assert torch.equal(torch.cat(recut.momentum), torch.cat(outer.momentum))
    assert recut.pending_at == [NOT_PENDING, NOT_PENDING] and recut.started == 10

    other = OuterSync(spec, [*_model().parameters(), torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="another model"):
        other.load_state_dict(state)


def test_a_boundary_waits_between_sites_only_where_a_sync_finishes() -> None:
    """Where it does, the session lifts the learnt timeout off the site's group."""
    diloco = OuterSync(SyncSpec(mode=SyncMode.DILOCO, inner_steps=4), list(_model().parameters()))
    waits = []
    for done in range(1, 10):  # each boundary asks before its syncs start
        waits += [done] if diloco.waits_at(done) else []
        diloco.started = done
    assert waits == [4, 8]
    spec = SyncSpec(mode=SyncMode.STREAMING_DILOCO, inner_steps=4, fragments=2, delay_steps=1)
    streaming = OuterSync(spec, list(_model().parameters()))
    assert not streaming.waits_at(2)  # fragment 0 starts at 2: its all-gather runs behind
    streaming.pending_at[0], streaming.started = 2, 2
    assert streaming.waits_at(3) and not streaming.waits_at(2)  # its result, one step later
    streaming.end = 2  # the run's last boundary waits for every sync under way
    assert streaming.waits_at(2)


# -- the job file --------------------------------------------------------------------------


def _job(sync: dict[str, object], **more: object) -> object:
    return load_job_data({"name": "d", "entrypoint": {"script": "t.py"}, "sync": sync, **more})


def test_sync_defaults_come_from_the_papers() -> None:
    spec = _job({"mode": "diloco"}).sync  # type: ignore[attr-defined]
    assert spec.inner_steps == 100 and spec.fragments == 1
    assert spec.outer_optimizer.lr == 0.7 and spec.outer_optimizer.momentum == 0.9
    assert spec.site_label == "zone"
    # DiLoCo: float32 pseudo-gradients, and the global parameters replace a site's
    assert spec.outer_quantization is None and spec.alpha is None
    assert spec.quantization is OuterQuantization.NONE and spec.mixing == 0.0
    # Streaming DiLoCo: 4-bit floats, and a site keeps half of its own fragment
    streaming = _job({"mode": "streaming_diloco", "fragments": 4}).sync  # type: ignore[attr-defined]
    assert streaming.quantization is OuterQuantization.E3M0 and streaming.mixing == 0.5
    # under ddp nothing travels between sites
    ddp = _job({}).sync  # type: ignore[attr-defined]
    assert ddp.quantization is OuterQuantization.NONE and ddp.mixing == 0.0


_MODES: dict[str, dict[str, object]] = {
    "diloco": {"mode": "diloco"},
    "streaming_diloco": {"mode": "streaming_diloco", "fragments": 2},
}


@pytest.mark.parametrize("mode", list(_MODES))
@pytest.mark.parametrize(
    ("written", "kind"),
    [
        ("none", OuterQuantization.NONE),
        ("bf16", OuterQuantization.BF16),
        ("8bit", OuterQuantization.INT8),
        ("4bit", OuterQuantization.INT4),
        ("e3m0", OuterQuantization.E3M0),
    ],
)
def test_a_written_quantization_is_used_in_either_mode(
    mode: str, written: str, kind: OuterQuantization
) -> None:
    """Job files written before the default followed the mode keep their meaning: the
    uniform ``4bit`` stays the uniform integers, ``none`` float32."""
    spec = _job({**_MODES[mode], "outer_quantization": written}).sync  # type: ignore[attr-defined]
    assert spec.outer_quantization is kind and spec.quantization is kind


@pytest.mark.parametrize(("mode", "alpha"), [("diloco", 0.25), ("streaming_diloco", 0)])
def test_a_written_alpha_is_used_in_either_mode(mode: str, alpha: float) -> None:
    spec = _job({**_MODES[mode], "alpha": alpha}).sync  # type: ignore[attr-defined]
    assert spec.alpha == alpha and spec.mixing == alpha


def test_an_old_ddp_job_file_that_wrote_no_quantization_still_loads() -> None:
    """``outer_quantization: none`` was the default: a job file under mode ddp that wrote
    it loads as before; any other value is refused there (it would be ignored)."""
    assert _job({"outer_quantization": "none"}).sync.quantization is OuterQuantization.NONE  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("sync", "field", "words"),
    [
        ({"mode": "streaming_diloco", "fragments": 1}, "sync.fragments", "2 or more"),
        (
            {"mode": "streaming_diloco", "inner_steps": 10, "fragments": 3},
            "sync.fragments",
            "must divide inner_steps",
        ),
        ({"mode": "diloco", "fragments": 2}, "sync.fragments", "only streaming_diloco"),
        (
            {"mode": "diloco", "inner_steps": 10, "delay_steps": 10},
            "sync.delay_steps",
            "below the steps between two syncs",
        ),
        ({"mode": "ddp", "delay_steps": 1}, "sync.delay_steps", "diloco"),
        # under ddp a delayed sync's settings would be ignored: each is named
        ({"inner_steps": 50}, "sync.inner_steps", "diloco and streaming_diloco only"),
        ({"mode": "ddp", "inner_steps": 0}, "sync.inner_steps", "got 0: remove it"),
        (
            {"outer_optimizer": {"name": "sgd", "lr": 1, "momentum": 0}},
            "sync.outer_optimizer",
            "got {name: sgd, lr: 1, momentum: 0}",
        ),
        ({"outer_quantization": "4bit"}, "sync.outer_quantization", "got 4bit"),
        ({"mode": "ddp", "outer_quantization": "e3m0"}, "sync.outer_quantization", "got e3m0"),
        ({"mode": "ddp", "alpha": 0.5}, "sync.alpha", "diloco and streaming_diloco only"),
        ({"alpha": 0}, "sync.alpha", "got 0: remove it, or set sync.mode"),
        ({"mode": "streaming_diloco", "fragments": 2, "alpha": 1}, "sync.alpha", "below 1"),
        ({"mode": "diloco", "alpha": 1}, "sync.alpha", "never take the global model"),
        ({"mode": "diloco", "alpha": -0.1}, "sync.alpha", "at least 0"),
        ({"mode": "diloco", "alpha": "half"}, "sync.alpha", "must be"),
        ({"mode": "ddp", "site_label": "rack"}, "sync.site_label", "set sync.mode"),
        ({"mode": "diloco", "outer_optimizer": {"lr": 0}}, "sync.outer_optimizer.lr", "above 0"),
        (
            {"mode": "diloco", "outer_optimizer": {"momentum": 1}},
            "sync.outer_optimizer.momentum",
            "below 1",
        ),
        ({"mode": "diloco", "outer_quantization": "2bit"}, "sync.outer_quantization", "4bit"),
        ({"mode": "diloco", "site_label": " "}, "sync.site_label", "node label"),
    ],
)
def test_bad_sync_settings_name_the_field(sync: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        _job(sync)
    text = str(err.value)
    assert field in text and words in text, text


def test_a_delayed_sync_needs_the_runtime() -> None:
    with pytest.raises(SpecError, match=r"sync\.mode"):
        _job({"mode": "diloco"}, fault_tolerance={"recovery": "restart"})


def test_run_labels_name_nodes_of_the_run() -> None:
    nodes = ["node-0", "node-1", "node-2"]
    got = node_labels_from(["node-1:zone=b", "node-1:rack=r2", "node-2:zone=b"], nodes)
    assert got == {"node-1": {"zone": "b", "rack": "r2"}, "node-2": {"zone": "b"}}
    with pytest.raises(ValueError, match="NODE:KEY=VALUE"):
        node_labels_from(["zone=b"], nodes)
    with pytest.raises(ValueError, match="not node-7"):
        node_labels_from(["node-7:zone=b"], nodes)


def test_spares_come_from_the_largest_sites() -> None:
    order = [
        NodeInfo("n0", 1, {"zone": "a", "rack": "r0"}),
        NodeInfo("n2", 1, {"zone": "a", "rack": "r1"}),
        NodeInfo("n1", 1, {"zone": "b", "rack": "r0"}),
    ]
    # the rack rule alone would leave site b without a member
    assert spread_spares(order, 1, ["zone", "rack", "host"]) == ["n1"]
    assert spares_by_site(order, 1, "zone") == ["n2"]
    assert spares_by_site(order, 2, "zone") == ["n2", "n1"]  # a tie: the later site
