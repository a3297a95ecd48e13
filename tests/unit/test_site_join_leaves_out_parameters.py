"""What a site without state is sent: the other site's state without the parameters the
anchors replace on arrival (a sixth of a DiLoCo job's state under AdamW and an EMA)."""

from __future__ import annotations

import pytest
import torch

from agents.api import StateMismatchError
from agents.recovery.site_join import LeftOut, put_back, without_parameters
from agents.recovery.state_sync import split_tensors

pytestmark = pytest.mark.unit


class _Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight, and a batch norm's buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight


def _state(model: torch.nn.Module) -> dict[str, object]:
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"step": 3, "tracked": {"model": model.state_dict(), "ema": ema}, "rng": None}


def test_only_the_models_own_parameters_are_left_out() -> None:
    torch.manual_seed(0)
    model = _Tied()
    sent = without_parameters(lambda: _state(model), list(model.parameters()))
    kept = sent["tracked"]["model"]
    # both names of the tied weight, and the norm's affine parameters, stay behind
    left_out = sorted(k for k, v in kept.items() if isinstance(v, LeftOut))
    assert left_out == ["embed.weight", "norm.bias", "norm.weight", "out.weight"]
    # buffers (running statistics) are not parameters: they travel
    assert torch.equal(kept["norm.running_mean"], model.norm.running_mean)
    # a copy of the parameters (an EMA) is not the parameters: it travels whole
    assert not any(isinstance(v, LeftOut) for v in sent["tracked"]["ema"].values())
    full = sum(t.numel() for t in split_tensors(_state(model))[1])
    less = sum(t.numel() for t in split_tensors(sent)[1])
    assert full - less == 7 * 4 * 2 + 4 + 4  # the tied weight twice, the norm's two


def test_the_receiver_puts_its_own_parameters_back_and_loads_the_rest() -> None:
    torch.manual_seed(0)
    source, receiver = _Tied(), _Tied()
    with torch.no_grad():
        source.norm.running_mean.fill_(5.0)
    sent = without_parameters(lambda: _state(source), list(source.parameters()))
    state = put_back(sent, _state(receiver))
    # where a parameter was left out stands the receiver's own (the anchors follow)
    placed = state["tracked"]["model"]["embed.weight"]
    assert placed.data_ptr() == receiver.embed.weight.data_ptr()
    receiver.load_state_dict(state["tracked"]["model"])  # strict: every key is there
    assert torch.equal(receiver.norm.running_mean, torch.full((4,), 5.0))
    assert state["tracked"]["ema"]["embed.weight"].equal(source.embed.weight)


def test_a_receiver_of_another_structure_is_told_so() -> None:
    model = _Tied()
    sent = without_parameters(lambda: _state(model), list(model.parameters()))
    other = {"step": 0, "tracked": {"model": {}, "ema": {}}, "rng": None}
    # the script's error, not a peer's failure: the join reports it and ends the worker
    with pytest.raises(StateMismatchError, match="same model"):
        put_back(sent, other)


def _streaming(momentum: float = 0.0) -> object:
    from orchestrator.spec.sync import OuterOptimizerName, OuterOptimizerSpec, SyncMode, SyncSpec

    name = OuterOptimizerName.NESTEROV if momentum else OuterOptimizerName.SGD
    return SyncSpec(
        mode=SyncMode.STREAMING_DILOCO,
        inner_steps=8,
        fragments=2,
        delay_steps=1,
        outer_optimizer=OuterOptimizerSpec(name=name, lr=1.0, momentum=momentum),
    )


def test_the_outer_buffers_a_new_site_does_not_need_are_left_out_too() -> None:
    """Its pseudo-gradients (it starts from the anchors: it has moved nothing since any
    sync started), and the momentum of an outer step without momentum: neither is
    sent; a used momentum and the anchors are."""
    from agents.sync.outer_sync import NOT_PENDING, OuterSync

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for momentum in (0.9, 0.0):
        outer = OuterSync(_streaming(momentum), list(model.parameters()))
        outer.pending_at = [4, NOT_PENDING]  # fragment 0's sync is under way
        left_out = [*outer.parameters, *outer.not_for_a_new_site()]
        sent = without_parameters(outer.state_dict, left_out)
        assert all(isinstance(d, LeftOut) for d in sent["pending_delta"])
        moments = sent["momentum"]
        assert all(isinstance(m, LeftOut if momentum == 0 else torch.Tensor) for m in moments)
        assert all(isinstance(a, torch.Tensor) for a in sent["anchors"])
        back = put_back(sent, outer.state_dict())  # the receiver's own take the places
        assert all(isinstance(t, torch.Tensor) for t in back["pending_delta"] + back["momentum"])


def test_a_new_site_keeps_only_its_own_steps_when_a_delayed_sync_lands() -> None:
    """Site a started fragment 0's sync at step 4 having moved it by +1; site b comes back
    without state, takes a's state and the anchors, trains one step (+0.5), and the
    sync's result (a's outer step: the anchor + 1) lands at step 5.  Site b merges that
    global fragment with its own (the anchor plus its own step, not plus a's
    pseudo-gradient as well), half and half as Streaming DiLoCo does."""
    from agents.sync.outer_step import flatten, pseudo_gradient
    from agents.sync.outer_sync import NOT_PENDING, OuterSync

    torch.manual_seed(0)
    site_a, site_b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    a = OuterSync(_streaming(), list(site_a.parameters()))
    first = [site_a.weight]  # fragment 0 (two parameters, two fragments)
    assert a.anchors[0].numel() == site_a.weight.numel()
    anchor = a.anchors[0].clone()
    with torch.no_grad():
        for p in first:
            p.add_(1.0)
    a.started, a.pending_at = 4, [4, NOT_PENDING]
    a.pending_delta[0] = pseudo_gradient(a.anchors[0], first)
    a.pending_weight = [1.0, 0.0]

    b = OuterSync(_streaming(), list(site_b.parameters()))
    b.pending_delta[0].fill_(7.0)  # whatever a fresh process holds: not used
    sent = without_parameters(a.state_dict, [*a.parameters, *a.not_for_a_new_site()])
    b.load_state_dict(put_back(sent, b.state_dict()))
    b.start_from_anchors(4)
    b_first = [site_b.weight]
    assert torch.equal(flatten(b_first), anchor)
    assert b.pending_weight == [0.0, 0.0] and not b.pending_delta[0].any()

    with torch.no_grad():
        for p in b_first:
            p.add_(0.5)  # site b's own inner step
    after = anchor + 1.0  # a's outer step (averaging: a was the only contributor)
    b.resolved[0] = (after, torch.zeros_like(after))
    b.after_step(5)
    assert b.spec.mixing == 0.5
    own = anchor + 0.5
    assert torch.allclose(flatten(b_first), 0.5 * own + 0.5 * after)  # the anchor + 0.75
    assert b.counts[0] == 1 and b.pending_at[0] == NOT_PENDING


def test_an_outer_state_not_restored_with_the_model_takes_its_anchors_from_it() -> None:
    """A model restored at step 1000 without an outer state (a checkpoint saved under
    sync.mode ddp): the anchors made at wrap() would count everything since the
    initial weights as one pseudo-gradient; they are taken from the restored model."""
    from agents.sync.outer_step import flatten
    from agents.sync.outer_sync import OuterSync
    from orchestrator.spec.sync import SyncMode, SyncSpec

    model = torch.nn.Linear(3, 2)
    outer = OuterSync(SyncSpec(mode=SyncMode.DILOCO, inner_steps=100), list(model.parameters()))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(5.0)  # what the restore put there
    outer.resume(1000)  # no group needed: no sync starts at 1000 once anchored there
    assert outer.started == 1000 and outer.counts == [0]
    assert torch.equal(outer.anchors[0], flatten(list(model.parameters())))
    assert all(bool((p == 5.0).all()) for p in model.parameters())  # the model untouched


def test_a_sync_no_site_contributed_to_applies_no_outer_step() -> None:
    """The only site that had started a sync is gone; the site left joined after it
    started (weight 0): no average exists, and no outer step is taken (in a real group
    of one rank: the all-gather of the weights is what tells)."""
    from datetime import timedelta

    import torch.distributed as dist

    from agents.sync.outer_step import flatten
    from agents.sync.outer_sync import NOT_PENDING, OuterSync
    from agents.sync.site_groups import form_site_groups
    from agents.sync.sites import Sites

    model = torch.nn.Linear(3, 2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        outer = OuterSync(_streaming(momentum=0.9), list(model.parameters()))
        sites = Sites(("b",), ((0,),))
        outer.groups = form_site_groups(sites, 0, torch.device("cpu"), timedelta(seconds=30))
        anchors = [a.clone() for a in outer.anchors]
        with torch.no_grad():
            model.weight.add_(0.5)  # this site's own inner steps since it joined
        before = flatten(list(model.parameters()))
        outer.started, outer.pending_at, outer.pending_weight = 4, [4, NOT_PENDING], [0.0, 0.0]
        outer.resume(5)  # exchanges fragment 0 again; its result is due at 5
        assert outer.pending_at == [NOT_PENDING, NOT_PENDING] and outer.counts == [0, 0]
        assert all(torch.equal(a, b) for a, b in zip(outer.anchors, anchors, strict=True))
        assert torch.equal(flatten(list(model.parameters())), before)
    finally:
        dist.destroy_process_group()
