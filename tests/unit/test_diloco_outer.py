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
    bound = {"none": 0.0, "bf16": 2**-8, "8bit": 0.5 / 127, "4bit": 0.5 / 7}[kind.value]
    assert (x - y).abs().max() <= bound * x.abs().max() + 1e-12
    assert torch.equal(decode(payload, kind, 1000), y)  # every site decodes the same bits


def test_four_bits_cost_an_eighth_of_float32_and_the_scales() -> None:
    n = 1 << 20
    assert payload_bytes(n, OuterQuantization.NONE) / payload_bytes(n, OuterQuantization.INT4) > 7.7


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
