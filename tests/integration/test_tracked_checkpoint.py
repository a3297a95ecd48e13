"""Every object of a TrainState's ``objects`` goes through a real durable checkpoint.

A GradScaler, an LR scheduler under another name, EMA weights, a plain
counter and a ``torch.distributed.checkpoint`` ``Stateful`` are saved with a
real :class:`~checkpoint.Checkpointer` on local disk and loaded into freshly
built objects.  An asynchronous save writes the objects as they were when it
started, and an object the checkpoint does not hold is left as constructed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from checkpoint import Checkpointer, TrainState

pytestmark = pytest.mark.integration


class Counter:
    """A user's counter: anything with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])


class TokensSeen(Stateful):
    def __init__(self) -> None:
        self.tokens = torch.zeros(3, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tokens = state_dict["tokens"].clone()


def build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return {
        "model": model,
        "optimizer": opt,
        "scaler": torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1),
        "warmup": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10)),
        "ema": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)),
        "counter": Counter(),
        "tokens": TokensSeen(),
    }


def train(objs: dict[str, Any], steps: int, first: int = 0) -> None:
    model, opt, scaler = objs["model"], objs["optimizer"], objs["scaler"]
    for step in range(first, first + steps):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        objs["warmup"].step()
        objs["ema"].update_parameters(model)
        objs["counter"].value += 1
        objs["tokens"].tokens += torch.tensor([6, 12, 1])


def state_of(objs: dict[str, Any], **fields: Any) -> TrainState:
    others = {k: v for k, v in objs.items() if k not in ("model", "optimizer")}
    return TrainState(objs["model"], objs["optimizer"], objects=others, **fields)


def summary(objs: dict[str, Any]) -> dict[str, Any]:
    return {
        "scale": objs["scaler"].get_scale(),
        "warmup": objs["warmup"].state_dict()["last_epoch"],
        "lr": objs["optimizer"].param_groups[0]["lr"],
        "ema": {k: v.clone() for k, v in objs["ema"].state_dict().items()},
        "counter": objs["counter"].value,
        "tokens": objs["tokens"].tokens.tolist(),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k == "ema":
            assert a[k].keys() == b[k].keys()
            for name in a[k]:
                assert torch.equal(a[k][name], b[k][name]), f"ema {name} differs"
        else:
            assert a[k] == b[k], f"{k}: {a[k]} != {b[k]}"


def test_tracked_objects_round_trip_through_a_durable_checkpoint(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ckpt"
    objs = build(seed=0)
    train(objs, 3)
    saved = summary(objs)
    assert saved["scale"] > 256.0 and saved["counter"] == 3  # training changed them

    ckpt = Checkpointer(url, keep=2)
    handle = ckpt.save_async(3, state_of(objs, samples_seen=18))
    assert handle is not None
    train(objs, 1, first=3)  # the next step runs while the save uploads
    handle.wait()
    ckpt.close()

    fresh = build(seed=1)
    assert fresh["counter"].value == 0 and fresh["scaler"].get_scale() == 256.0
    state = state_of(fresh)
    result = Checkpointer(url, keep=2).restore(state)
    assert result.step == 3 and state.samples_seen == 18
    assert_same(summary(fresh), saved)
    assert state.extra == {}, "the objects' states must not show up in extra"
    # the restored objects train on exactly as the originals would have
    train(fresh, 1, first=3)
    twin = build(seed=0)
    train(twin, 4)
    assert_same(summary(fresh), summary(twin))


def test_an_object_the_checkpoint_lacks_is_left_as_constructed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"file://{tmp_path}/ckpt"
    objs = build(seed=0)
    train(objs, 2)
    without_tokens = {k: v for k, v in objs.items() if k != "tokens"}
    Checkpointer(url, keep=2).save_now(2, state_of(without_tokens))

    fresh = build(seed=1)
    with caplog.at_level(logging.WARNING, logger="checkpoint.checkpointer"):
        Checkpointer(url, keep=2).restore(state_of(fresh))
    assert fresh["counter"].value == 2
    assert fresh["tokens"].tokens.tolist() == [0, 0, 0]
    assert "'tokens'" in caplog.text and "left as constructed" in caplog.text
