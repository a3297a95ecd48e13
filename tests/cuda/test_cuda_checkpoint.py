"""Checkpoints from GPU memory: staged on a side stream, never torn by training.

``save_async`` returns once the device-to-host copies are queued on a side
stream ordered before the next step's work; the optimizer steps that run
right after it must not leak into the checkpoint, and a restore puts the
state back onto the GPU.  No process group: a checkpointer of one rank.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from checkpoint import Checkpointer, TrainState
from tests.cuda.conftest import record

pytestmark = pytest.mark.integration


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()


def test_async_save_from_gpu_holds_the_step_it_was_asked_for(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(64, 2048, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    at_save = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = {
        (i, k): v.detach().clone()
        for i, s in opt.state_dict()["state"].items()
        for k, v in s.items()
    }
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt", keep=2)
    state = TrainState(model, opt, samples_seen=64)
    ckpt.prepare(state)  # buffers allocated (and pinned) before the timed save
    torch.cuda.synchronize()
    started = time.perf_counter()
    handle = ckpt.save_async(1, state)
    blocked = time.perf_counter() - started
    assert handle is not None
    for _ in range(5):  # training goes on at once: these steps change every parameter
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    handle.wait(timedelta(seconds=120))
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(after[k], at_save[k]) for k in at_save)

    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    unstepped = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    result = Checkpointer(f"file://{tmp_path}/ckpt").restore(TrainState(fresh, unstepped))
    assert result.step == 1
    for k, v in fresh.state_dict().items():
        assert v.is_cuda, f"{k} restored to {v.device}"
        assert torch.equal(v, at_save[k]), f"{k}: the checkpoint holds a later step's values"
    # the optimizer that never stepped gets the saved moments on the GPU (its state is
    # shaped from the checkpoint, not made by a zero-gradient step)
    restored = unstepped.state_dict()["state"]
    assert {(i, k) for i, s in restored.items() for k in s} == set(moments)
    for (i, k), v in moments.items():
        got = restored[i][k]
        assert got.device == v.device, f"{k} of parameter {i} restored to {got.device}"
        assert torch.equal(got, v), f"{k} of parameter {i} differs from the one saved"
    assert all(p.grad is None for p in fresh.parameters())
    record("gpu_async_save_small", blocking_ms=round(blocked * 1e3, 2))
    ckpt.close()
