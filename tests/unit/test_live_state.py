"""Which tensors of a worker's live state every rank at one step holds alike.

A DDP model's parameters and the optimizer that steps only them: yes; its buffers
(a BatchNorm's running statistics come from each rank's own batches), an optimizer
with a parameter of another module, and a model tracked that is not the DDP's: no.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agents.recovery.replicas import capture, replicated
from agents.recovery.state_sync import _tensor_paths

pytestmark = pytest.mark.unit


class _Wrapped(nn.Module):
    """Stands for the runtime's DDP wrapper: the model is its ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        return self.module.state_dict(*args, **kwargs)


def _alike(tracked: dict[str, object], module: nn.Module) -> dict[tuple[object, ...], bool]:
    rule = replicated(tracked, module)  # type: ignore[arg-type]
    assert rule is not None
    return {p: rule(p) for p in _tensor_paths(capture(3, tracked))}  # type: ignore[arg-type]


def test_parameters_and_their_optimizer_are_alike_buffers_are_not() -> None:
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model = _Wrapped(module)
    opt = torch.optim.Adam(model.parameters())
    module(torch.randn(3, 4)).sum().backward()
    opt.step()
    alike = _alike({"model": model, "optimizer": opt}, module)
    assert alike[("tracked", "model", "0.weight")] and alike[("tracked", "model", "1.bias")]
    assert not alike[("tracked", "model", "1.running_mean")]
    assert not alike[("tracked", "model", "1.num_batches_tracked")]
    assert alike[("tracked", "optimizer", "state", 0, "exp_avg")]
    assert not alike[("rng",)]


def test_an_optimizer_of_other_parameters_too_is_not_alike() -> None:
    module = nn.Linear(4, 4)
    model, other = _Wrapped(module), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([*model.parameters(), other], lr=0.1, momentum=0.9)
    module(torch.randn(3, 4)).sum().backward()
    other.grad = torch.ones(2)
    opt.step()
    alike = _alike({"model": model, "optimizer": opt}, module)
    assert alike[("tracked", "model", "weight")]
    optimizer = [v for k, v in alike.items() if k[:2] == ("tracked", "optimizer")]
    assert optimizer and not any(optimizer)


def test_a_model_tracked_that_is_not_the_ddps_shares_nothing() -> None:
    module = nn.Linear(4, 4)
    assert replicated({"model": nn.Linear(4, 4)}, module) is None  # type: ignore[dict-item]
    assert replicated({}, module) is None
