"""The state sync's split into structure and flat buffers, and back."""

from __future__ import annotations

import pickle

import pytest
import torch

from agents.recovery.state_sync import join_tensors, split_tensors

pytestmark = pytest.mark.unit


def test_state_round_trips_through_flat_buffers() -> None:
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {
        "step": 7,
        "tracked": {"model": model.state_dict(), "optimizer": opt.state_dict()},
        "rng": torch.get_rng_state(),
        "mask": torch.tensor([True, False, True]),
        "pair": (torch.arange(4, dtype=torch.int64).view(2, 2), "label"),
    }
    skeleton, tensors = split_tensors(state)
    # the structure pickles small: no tensor data in it
    assert len(pickle.dumps(skeleton)) < 2000
    buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    for dtype in {t.dtype for t in tensors}:
        buffers[("cpu", dtype)] = torch.cat([t.reshape(-1) for t in tensors if t.dtype == dtype])
    assert len(buffers) == 4  # float32, int64... one flat buffer per dtype
    back = join_tensors(skeleton, buffers)
    assert back["step"] == 7 and back["pair"][1] == "label"
    torch.testing.assert_close(back["rng"], state["rng"])
    assert torch.equal(back["mask"], state["mask"])
    assert torch.equal(back["pair"][0], state["pair"][0])
    fresh = torch.nn.Linear(8, 3)
    fresh.load_state_dict(back["tracked"]["model"])
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    fresh_opt.load_state_dict(back["tracked"]["optimizer"])
    assert torch.equal(
        fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
