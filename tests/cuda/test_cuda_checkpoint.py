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
    result = Checkpointer(f"file://{tmp_path}/ckpt").restore(
        TrainState(fresh, torch.optim.Adam(fresh.parameters(), lr=1e-2))
    )
    assert result.step == 1
    for k, v in fresh.state_dict().items():
        assert v.is_cuda, f"{k} restored to {v.device}"
        assert torch.equal(v, at_save[k]), f"{k}: the checkpoint holds a later step's values"
    record("gpu_async_save_small", blocking_ms=round(blocked * 1e3, 2))
    ckpt.close()
