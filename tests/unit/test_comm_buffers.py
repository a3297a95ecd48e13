"""Per-parameter hook buffers: bucket rebuilds and save/restore keep every element's state."""

from __future__ import annotations

import pytest
import torch

from agents.comm.api import HookStateError
from agents.comm.buffers import BufferStore

pytestmark = pytest.mark.unit


def test_rebuilt_buckets_carry_each_parameters_residual() -> None:
    store = BufferStore(("residual",))
    first = store.get(("a", "b"), [2, 3])
    first["residual"].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    other = store.get(("c",), [1])
    other["residual"].fill_(9.0)
    # DDP rebuilds: now (c, b) and (a,) share buckets differently.
    cb = store.get(("c", "b"), [1, 3])
    a = store.get(("a",), [2])
    assert cb["residual"].tolist() == [9.0, 3.0, 4.0, 5.0]
    assert a["residual"].tolist() == [1.0, 2.0]


def test_state_dict_is_per_parameter_and_loads_into_other_bucketing() -> None:
    store = BufferStore(("momentum", "residual"))
    bufs = store.get(("a", "b"), [2, 1])
    bufs["residual"].copy_(torch.tensor([1.0, 2.0, 3.0]))
    bufs["momentum"].copy_(torch.tensor([4.0, 5.0, 6.0]))
    saved = store.state_dict()
    assert saved["buffers"]["b"]["residual"].tolist() == [3.0]
    bufs["residual"].zero_()  # the saved copy is independent
    fresh = BufferStore(("momentum", "residual"))
    fresh.load_state_dict(saved)
    got = fresh.get(("b", "a", "new"), [1, 2, 4])
    assert got["residual"].tolist() == [3.0, 1.0, 2.0, 0, 0, 0, 0]
    assert got["momentum"].tolist()[:3] == [6.0, 4.0, 5.0]


def test_padding_is_not_saved() -> None:
    store = BufferStore(("residual",))
    bufs = store.get(("a",), [3], length=4)
    assert bufs["residual"].numel() == 4
    assert store.state_dict()["buffers"]["a"]["residual"].numel() == 3


def test_loading_other_buffer_names_is_refused() -> None:
    saved = BufferStore(("residual",)).state_dict()
    with pytest.raises(HookStateError, match="different compression"):
        BufferStore(("momentum", "residual")).load_state_dict(saved)
