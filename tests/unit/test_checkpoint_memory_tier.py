"""The memory tier: double-buffered shared-memory copy of a rank's state."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    RestoreSource,
    SharedMemoryTier,
    StateTier,
    TrainState,
)
from checkpoint.flat_state import capture

pytestmark = pytest.mark.unit


def _flat(value: float) -> dict[str, Any]:
    return {
        "w": torch.full((3, 5), value),
        "b": torch.arange(7, dtype=torch.int64) + int(value),
        "flag": torch.tensor([True, False]),
        "lr": value / 10,
        "groups": [{"params": ["w"], "lr": value}],
    }


def test_put_get_and_load_in_place(tmp_path: Any) -> None:
    tier = SharedMemoryTier(tmp_path / "rank-0")
    assert isinstance(tier, StateTier)
    assert tier.latest_step() is None
    tier.put(1, _flat(1.0))
    tier.put(2, _flat(2.0))
    step, flat = tier.get()
    assert step == 2 and flat["lr"] == 0.2 and torch.equal(flat["w"], torch.full((3, 5), 2.0))
    target = _flat(0.0)
    w = target["w"]
    tier.load(2, target)
    assert target["w"] is w and torch.equal(w, torch.full((3, 5), 2.0))
    assert torch.equal(target["b"], torch.arange(7) + 2) and target["groups"][0]["lr"] == 2.0
    with pytest.raises(CheckpointNotFoundError):
        tier.load(1, target)


def test_an_interrupted_put_leaves_the_previous_step_intact(tmp_path: Any) -> None:
    tier = SharedMemoryTier(tmp_path / "rank-0")
    tier.put(1, _flat(1.0))
    tier.put(2, _flat(2.0))
    # A put of step 3 writes the slot the head does not point to; a crash
    # half-way leaves that slot with garbage and the head unchanged.
    inactive = tmp_path / "rank-0" / "slot-0.bin"
    inactive.write_bytes(b"\xff" * 100)
    reopened = SharedMemoryTier(tmp_path / "rank-0")
    step, flat = reopened.get()
    assert step == 2 and torch.equal(flat["w"], torch.full((3, 5), 2.0))


def test_shape_mismatch_is_refused(tmp_path: Any) -> None:
    tier = SharedMemoryTier(tmp_path / "rank-0")
    tier.put(1, _flat(1.0))
    target = _flat(0.0)
    target["w"] = torch.zeros(2, 2)
    with pytest.raises(CheckpointMismatchError, match="shape"):
        tier.load(1, target)


def test_restore_prefers_fresher_memory_over_durable(tmp_path: Any) -> None:
    url = f"memory://mem-{uuid.uuid4().hex[:8]}/ckpt"
    model = torch.nn.Linear(3, 3)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), samples_seen=4)
    ckpt = Checkpointer(url, memory_directory=str(tmp_path / "shm"))
    ckpt.save_now(1, state)
    with torch.no_grad():
        model.weight.add_(1.0)
    state.samples_seen = 8
    state.rank_state["err"] = torch.ones(2)
    ckpt.snapshot(2, state)
    expected = model.weight.detach().clone()

    with torch.no_grad():
        model.weight.zero_()
    state.rank_state.clear()
    result = ckpt.restore(state)
    assert result.source is RestoreSource.MEMORY and result.step == 2
    assert result.samples_seen == 8 and state.samples_seen == 8
    assert torch.equal(model.weight, expected) and torch.equal(
        state.rank_state["err"], torch.ones(2)
    )

    ckpt.save_now(3, state)  # durable is now newer than memory
    result = ckpt.restore(state)
    assert result.source is RestoreSource.DURABLE and result.step == 3


def test_durable_storage_is_a_tier_too() -> None:
    from checkpoint.durable import DurableTier

    ckpt = Checkpointer(f"memory://tier-{uuid.uuid4().hex[:8]}/ckpt")
    tier = DurableTier(ckpt.root, ckpt.coord)
    assert isinstance(tier, StateTier) and tier.name is RestoreSource.DURABLE
    assert tier.latest_step() is None
    model = torch.nn.Linear(2, 2)
    ckpt.save_now(4, TrainState(model))
    assert tier.latest_step() == 4
    target, _ = capture(TrainState(torch.nn.Linear(2, 2)), rank=0)
    tier.load(4, target)
    assert torch.equal(target["model.weight"], model.weight)
    with pytest.raises(CheckpointNotFoundError):
        tier.load(3, target)


def test_memory_tier_layout_matches_capture(tmp_path: Any) -> None:
    model = torch.nn.Linear(2, 2)
    flat, _ = capture(TrainState(model), rank=0)
    tier = SharedMemoryTier(tmp_path / "r")
    tier.put(5, flat)
    assert tier.keys() == set(flat)
    tier.clear()
    assert tier.latest_step() is None
