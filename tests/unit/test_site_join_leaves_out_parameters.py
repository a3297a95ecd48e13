"""What a site without state is sent: the other site's state without the parameters the
anchors replace on arrival (a sixth of a DiLoCo job's state under AdamW and an EMA)."""

from __future__ import annotations

import pytest
import torch

from agents.recovery.state_sync import split_tensors
from agents.sync.site_join import LeftOut, put_back, without_parameters

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
    with pytest.raises(RuntimeError, match="same model"):
        put_back(sent, other)


def test_the_outer_buffers_nothing_reads_are_left_out_too() -> None:
    """A fragment with no sync under way keeps a stale pseudo-gradient (its next start
    overwrites it), and an outer step without momentum never reads its buffer: neither
    is sent; a pending fragment's pseudo-gradient and a used momentum are."""
    from agents.sync.outer_sync import NOT_PENDING, OuterSync
    from orchestrator.spec_sync import OuterOptimizerName, OuterOptimizerSpec, SyncMode, SyncSpec

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for name, momentum in ((OuterOptimizerName.NESTEROV, 0.9), (OuterOptimizerName.SGD, 0.0)):
        spec = SyncSpec(
            mode=SyncMode.STREAMING_DILOCO,
            inner_steps=8,
            fragments=2,
            delay_steps=1,
            outer_optimizer=OuterOptimizerSpec(name=name, lr=1.0, momentum=momentum),
        )
        outer = OuterSync(spec, list(model.parameters()))
        outer.pending_at = [4, NOT_PENDING]  # fragment 0's sync is under way
        sent = without_parameters(outer.state_dict, [*outer.parameters, *outer.idle_buffers()])
        assert isinstance(sent["pending_delta"][1], LeftOut)
        assert isinstance(sent["pending_delta"][0], torch.Tensor)
        moments = sent["momentum"]
        assert all(isinstance(m, LeftOut if momentum == 0 else torch.Tensor) for m in moments)
        assert all(isinstance(a, torch.Tensor) for a in sent["anchors"])
        back = put_back(sent, outer.state_dict())  # the receiver's own take the places
        assert all(isinstance(t, torch.Tensor) for t in back["pending_delta"] + back["momentum"])
