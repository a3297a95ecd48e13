"""A restore reads each object once, verified before any of it is loaded; tracked objects'
tensors are checkpoint entries of their own.

Over file:// with a local filesystem that counts what is read (a real one, counted).
"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from checkpoint import Checkpointer, RestoreSource, TrainState
from checkpoint.checkpointer import OBJECTS_KEY
from checkpoint.object_state import TensorSlot, join_tensors, live_object_targets, split_tensors

pytestmark = pytest.mark.unit


class CountingFileSystem(LocalFileSystem):
    """The local filesystem, counting whole-object reads (``cat_file``) and files opened
    for reading (each ``cat_file`` opens one too)."""

    cachable = False  # an instance of its own for each test

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetched: collections.Counter[str] = collections.Counter()
        self.opened: collections.Counter[str] = collections.Counter()

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        self.fetched[Path(path).name] += 1
        return super().cat_file(path, start, end, **kwargs)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode:
            self.opened[Path(path).name] += 1
        return super()._open(path, mode, *args, **kwargs)


class Counter:
    """A tracked object whose state is nested: tensors in a list and a tuple, plain values."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.state = collections.OrderedDict(
            count=seed,
            history=[torch.randn(3, generator=g), "note", (torch.randn(2, 2, generator=g), 7)],
        )

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    ema = torch.nn.Linear(8, 8)
    if seed == 0:
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()
    return TrainState(
        model, optimizer, samples_seen=seed, objects={"ema": ema, "counter": Counter(seed)}
    )


def _tensors(state: TrainState) -> list[torch.Tensor]:
    assert state.optimizer is not None
    out = list(state.model.state_dict().values()) + list(state.objects["ema"].parameters())
    saved = state.optimizer.state_dict()["state"]
    for index in sorted(saved):  # by parameter and entry name: their order is not state
        out += [saved[index][k] for k in sorted(saved[index]) if torch.is_tensor(saved[index][k])]
    history = state.objects["counter"].state["history"]
    return [*out, history[0], history[2][0]]


def _same(a: TrainState, b: TrainState) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def _flip_a_byte(ckpt: Checkpointer, step: int) -> None:
    info = next(i for i in ckpt.list() if i.step == step)
    path = Path(ckpt.root.child(info.name).path("__0_0.distcp"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


def test_restore_reads_each_object_once_and_restores_the_state(tmp_path: Path) -> None:
    saved = _state(0)
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(3, saved)
    fs = CountingFileSystem()
    fresh = _state(1)
    result = Checkpointer(f"file://{tmp_path}/ckpt", filesystem=fs).restore(fresh)
    assert result.source is RestoreSource.DURABLE and result.step == 3
    assert _same(saved, fresh) and fresh.samples_seen == 0
    assert fresh.objects["counter"].state["count"] == 0
    history = fresh.objects["counter"].state["history"]
    assert history[1] == "note" and history[2][1] == 7
    # read once, whole (the local filesystem's cat_file opens the file it reads)
    assert fs.fetched["__0_0.distcp"] == 1 and fs.opened["__0_0.distcp"] == 1
    assert {"prepare", "find", "verify", "load", "apply"} <= set(result.seconds)


def test_without_a_buffer_each_object_is_read_twice(tmp_path: Path) -> None:
    saved = _state(0)
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(3, saved)
    fs = CountingFileSystem()
    fresh = _state(1)
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt", filesystem=fs, restore_buffer_bytes=0)
    assert ckpt.restore(fresh).step == 3 and _same(saved, fresh)
    assert fs.fetched["__0_0.distcp"] == 0 and fs.opened["__0_0.distcp"] == 2


def test_a_flipped_byte_is_refused_before_anything_is_loaded(tmp_path: Path) -> None:
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt", keep=3)
    older = _state(0)
    ckpt.save_now(1, older)
    newer = _state(0)
    with torch.no_grad():
        for p in newer.model.parameters():
            p.add_(1.0)
    ckpt.save_now(2, newer)
    _flip_a_byte(ckpt, 2)
    fresh = _state(1)
    result = Checkpointer(f"file://{tmp_path}/ckpt").restore(fresh)
    assert result.step == 1 and len(result.skipped) == 1 and "checksum" in result.skipped[0]
    assert _same(older, fresh)

    # the only checkpoint corrupt: a fresh start, and the state is as it was built
    lone = Checkpointer(f"file://{tmp_path}/lone")
    lone.save_now(1, _state(0))
    _flip_a_byte(lone, 1)
    untouched, built = _state(2), _state(2)
    result = Checkpointer(f"file://{tmp_path}/lone").restore(untouched)
    assert result.source is RestoreSource.NONE and result.skipped
    assert all(
        torch.equal(a, b)
        for a, b in zip(untouched.model.parameters(), built.model.parameters(), strict=True)
    )


def test_object_tensors_are_entries_and_the_pickled_part_holds_none(tmp_path: Path) -> None:
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt")
    ckpt.save_now(1, _state(0))
    info = ckpt.latest()
    assert info is not None
    with open(ckpt.root.child(info.name).path(".metadata"), "rb") as f:
        entries = pickle.load(f).state_dict_metadata
    objects = sorted(k for k in entries if k.startswith("objects."))
    assert objects == [
        "objects.counter/history/0",
        "objects.counter/history/2/0",
        "objects.ema/bias",
        "objects.ema/weight",
    ]
    assert tuple(entries["objects.ema/weight"].size) == (8, 8)


def test_a_checkpoint_with_whole_object_states_in_extra_still_restores(tmp_path: Path) -> None:
    # the layout written before object tensors were entries: state dicts inside ``extra``
    saved = _state(0)
    legacy = TrainState(
        saved.model,
        saved.optimizer,
        extra={OBJECTS_KEY: {n: o.state_dict() for n, o in saved.objects.items()}},
    )
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(1, legacy)
    fresh = _state(1)
    assert Checkpointer(f"file://{tmp_path}/ckpt").restore(fresh).step == 1
    assert _same(saved, fresh)


def test_split_and_join_keep_structure_and_module_metadata() -> None:
    state = torch.nn.Linear(3, 2).state_dict()
    skeleton, tensors = split_tensors("ema", {"m": state, "t": (1, torch.ones(2))})
    assert set(tensors) == {"objects.ema/m/weight", "objects.ema/m/bias", "objects.ema/t/1"}
    assert skeleton["m"]["weight"] == TensorSlot("objects.ema/m/weight")
    assert skeleton["m"]._metadata == state._metadata  # type: ignore[attr-defined]
    joined = join_tensors(skeleton, tensors, "here")
    assert torch.equal(joined["m"]["bias"], state["bias"]) and joined["t"][0] == 1
    assert joined["m"]._metadata == state._metadata


def test_keys_name_paths_quoted_and_are_numbered_where_two_paths_would_meet() -> None:
    t = torch.ones(1)
    _, tensors = split_tensors("a/b", {"layers.0.weight": t, "x/y": {3: t}})
    assert set(tensors) == {"objects.a%2Fb/layers.0.weight", "objects.a%2Fb/x%2Fy/3"}
    _, numbered = split_tensors("o", {0: t, "0": t, "n": t})
    assert set(numbered) == {"objects.o.0", "objects.o.1", "objects.o.2"}
    assert live_object_targets({"o": _Holder({0: t, "0": t})}) == {}


class _Holder:
    """A tracked object that keeps the tensors it is given and records them."""

    def __init__(self, state: dict[Any, Any]) -> None:
        self.state = state
        self.given: dict[Any, Any] = {}

    def state_dict(self) -> dict[Any, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        self.given = dict(state)
        self.state = dict(state)


def test_object_entries_load_into_the_live_objects_tensors_by_name(tmp_path: Path) -> None:
    """The same key is the same tensor: entries of equal shape listed in another order
    land where their names say, straight in the live object's memory; an entry the live
    object lacks gets memory of its own, one it has and the checkpoint lacks is left."""
    torch.manual_seed(0)
    a, b, gone = torch.randn(4, 4), torch.randn(4, 4), torch.randn(3)
    saving = _state(0)
    saving.objects = {"h": _Holder({"a": a, "b": b, "gone": gone})}
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(1, saving)

    live_b, live_a, extra = torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(2)
    holder = _Holder({"b": live_b, "a": live_a, "extra": extra})  # another order, one new
    resuming = _state(1)
    resuming.objects = {"h": holder}
    assert Checkpointer(f"file://{tmp_path}/ckpt").restore(resuming).step == 1
    assert torch.equal(holder.given["a"], a) and torch.equal(holder.given["b"], b)
    assert holder.given["a"].data_ptr() == live_a.data_ptr()  # filled in place
    assert holder.given["b"].data_ptr() == live_b.data_ptr()
    assert torch.equal(holder.given["gone"], gone) and "extra" not in holder.given
    assert torch.equal(extra, torch.zeros(2))


def _numbered_split(name: str, state: Any) -> tuple[Any, dict[str, Any]]:
    """The split of checkpoints written before keys named paths: ``objects.<name>.<n>``."""
    skeleton, own = split_tensors(name, state)
    renamed = {k: f"objects.{name}.{n}" for n, k in enumerate(own)}
    numbered = join_tensors(skeleton, {k: TensorSlot(v) for k, v in renamed.items()}, "here")
    return numbered, {renamed[k]: v for k, v in own.items()}


def test_a_checkpoint_with_numbered_object_keys_still_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _state(0)
    with monkeypatch.context() as m:
        m.setattr("checkpoint.checkpointer.split_tensors", _numbered_split)
        Checkpointer(f"file://{tmp_path}/ckpt").save_now(1, saved)
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt")
    info = ckpt.latest()
    assert info is not None
    with open(ckpt.root.child(info.name).path(".metadata"), "rb") as f:
        assert "objects.ema.0" in pickle.load(f).state_dict_metadata
    fresh = _state(1)
    assert ckpt.restore(fresh).step == 1
    assert _same(saved, fresh)
    assert torch.equal(
        fresh.objects["counter"].state["history"][0], saved.objects["counter"].state["history"][0]
    )


def test_tensors_that_cannot_be_written_in_place_get_memory_of_their_own(tmp_path: Path) -> None:
    """An expanded tensor (its elements share memory) and an inference tensor cannot be
    loaded into: their entries are restored into new memory, as before."""
    saving = _state(0)
    saving.objects = {"h": _Holder({"wide": torch.arange(4.0), "inf": torch.ones(3)})}
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(1, saving)
    with torch.inference_mode():
        inference = torch.zeros(3)
    holder = _Holder({"wide": torch.zeros(1).expand(4), "inf": inference})
    assert live_object_targets({"h": holder}) == {}
    resuming = _state(1)
    resuming.objects = {"h": holder}
    assert Checkpointer(f"file://{tmp_path}/ckpt").restore(resuming).step == 1
    assert torch.equal(holder.given["wide"], torch.arange(4.0))
    assert torch.equal(holder.given["inf"], torch.ones(3))
