"""A restore copies each tensor once, from verified bytes straight into the state.

* ``tensor_in_record``: a tensor saved by ``torch.save`` (as DCP writes each
  one) is found in place, for every dtype and layout; anything else gives None.
* ``LocationReader``: tensors of objects held in memory (a local object is
  mapped) are copied from those bytes, narrowed as DCP asks; the rest goes
  through DCP's reader.
* ``shape_from_checkpoint``: an optimizer that never stepped gets the saved
  state's shapes without a step, and only when the checkpoint accounts for
  every parameter; a restore that fails or finds nothing leaves no state.

Real checkpoints on a local disk (``file://``), real DCP loads.
"""

from __future__ import annotations

import io
import mmap
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    RestoreSource,
    TrainState,
)
from checkpoint.buffer_stream import BufferStream
from checkpoint.fsspec_storage import Location, torch_zip_crc_off
from checkpoint.location_reader import LocationReader
from checkpoint.optimizer_shapes import parameter_names, shape_from_checkpoint
from checkpoint.restore_reads import map_object
from checkpoint.tensor_records import tensor_in_record

pytestmark = pytest.mark.unit


def _record(value: Any, *, crc: bool = True) -> memoryview:
    buf = io.BytesIO()
    if crc:
        torch.save(value, buf)
    else:
        with torch_zip_crc_off():
            torch.save(value, buf)
    return memoryview(buf.getvalue())


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12.0).view(3, 4),
        torch.arange(12, dtype=torch.bfloat16).view(3, 4).t(),  # strided
        torch.tensor(7, dtype=torch.int64),  # 0-dim
        torch.empty(0, 5),
        torch.randn(64, 64, dtype=torch.float64),
        torch.tensor([True, False, True]),
    ],
)
@pytest.mark.parametrize("crc", [True, False])
def test_a_saved_tensor_is_found_in_place(tensor: torch.Tensor, crc: bool) -> None:
    record = _record(tensor, crc=crc)
    found = tensor_in_record(record)
    assert found is not None and found.dtype == tensor.dtype
    assert found.shape == tensor.shape and torch.equal(found, tensor)
    if tensor.numel():  # the bytes are the record's own, not a copy
        start = np.frombuffer(record, dtype=np.uint8).ctypes.data
        assert start <= found.data_ptr() < start + len(record)


def test_a_view_of_a_larger_storage_keeps_its_offset() -> None:
    whole = torch.arange(20.0)
    view = whole[5:11].view(2, 3)
    found = tensor_in_record(_record(view))
    assert found is not None and torch.equal(found, view)


@pytest.mark.parametrize(
    "value",
    [{"a": torch.ones(2)}, [torch.ones(1)], 3, torch.ones(2, requires_grad=True).grad],
)
def test_anything_but_one_tensor_is_left_to_torch_load(value: Any) -> None:
    assert tensor_in_record(_record(value)) is None


def test_bytes_that_are_no_record_give_none() -> None:
    assert tensor_in_record(memoryview(b"not a zip archive" * 8)) is None
    truncated = _record(torch.ones(100))
    assert tensor_in_record(truncated[: len(truncated) // 2]) is None


def test_a_compressed_entry_is_left_to_torch_load() -> None:
    buf = io.BytesIO()
    source = io.BytesIO(bytes(_record(torch.ones(4))))
    with (
        zipfile.ZipFile(source) as src,
        zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as dst,
    ):
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    assert tensor_in_record(memoryview(buf.getvalue())) is None


# --------------------------------------------------------------------- whole restores


def _state(seed: int, *, stepped: bool) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    if stepped:
        for _ in range(3):
            model(torch.randn(4, 6)).sum().backward()
            optimizer.step()
    return TrainState(model, optimizer)


def _optimizer_tensors(state: TrainState) -> dict[tuple[int, str], torch.Tensor]:
    assert state.optimizer is not None
    saved = state.optimizer.state_dict()["state"]
    return {(i, k): v for i, s in saved.items() for k, v in s.items()}


def _equal(a: TrainState, b: TrainState) -> bool:
    pa, pb = list(a.model.parameters()), list(b.model.parameters())
    oa, ob = _optimizer_tensors(a), _optimizer_tensors(b)
    return (
        all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
        and oa.keys() == ob.keys()
        and all(torch.equal(oa[k], ob[k]) for k in oa)
    )


def test_a_local_restore_copies_every_tensor_from_the_mapped_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _state(0, stepped=True)
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(5, saved)
    readers: list[LocationReader] = []
    original = LocationReader.read_data

    def counted(self: LocationReader, plan: Any, planner: Any) -> Any:
        readers.append(self)
        return original(self, plan, planner)

    monkeypatch.setattr(LocationReader, "read_data", counted)
    stepped_here: list[int] = []
    fresh = _state(1, stepped=False)
    assert fresh.optimizer is not None
    fresh.optimizer.register_step_pre_hook(lambda *a: stepped_here.append(1))
    result = Checkpointer(f"file://{tmp_path}/ckpt").restore(fresh)
    assert result.source is RestoreSource.DURABLE and result.step == 5
    assert _equal(saved, fresh)
    # the model's 4 tensors and Adam's 3 entries for each of them: every one read directly
    (reader,) = readers
    assert reader.dcp_items == 0 and reader.direct_items == 4 + 4 * 3
    assert reader.fetched and all(isinstance(b, mmap.mmap) for b in reader.fetched.values())
    # no optimizer step ran to make the state the load went into
    assert stepped_here == [] and all(p.grad is None for p in fresh.model.parameters())


def test_a_read_item_is_narrowed_as_dcp_asks(tmp_path: Path) -> None:
    saved = _state(0, stepped=True)
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(1, saved)
    info = Checkpointer(f"file://{tmp_path}/ckpt").latest()
    assert info is not None
    directory = Location.from_url(f"file://{tmp_path}/ckpt/{info.name}")
    path = directory.path("__0_0.distcp")
    reader = LocationReader(directory, {path: map_object(path)})
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    key = "model.0.weight"
    index = next(i for i in metadata.storage_data if i.fqn == key)
    target = torch.zeros(2, 3)

    class Planner:
        committed: list[torch.Tensor] = []

        def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
            return target

        def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
            self.committed.append(tensor)

    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(key),
        dest_offsets=torch.Size([0, 0]),
        storage_index=index,
        storage_offsets=torch.Size([4, 1]),
        lengths=torch.Size([2, 3]),
    )
    planner = Planner()
    reader.read_data(LoadPlan(items=[req]), planner).wait()  # type: ignore[arg-type]
    assert reader.direct_items == 1 and len(planner.committed) == 1
    assert planner.committed[0].data_ptr() == target.data_ptr()
    assert torch.equal(target, saved.model[0].weight.detach()[4:6, 1:4])


def test_a_checkpoint_that_does_not_cover_every_parameter_leaves_torch_its_step(
    tmp_path: Path,
) -> None:
    saved = _state(0, stepped=True)
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(1, saved)
    info = Checkpointer(f"file://{tmp_path}/ckpt").latest()
    assert info is not None
    directory = Location.from_url(f"file://{tmp_path}/ckpt/{info.name}")
    entries = LocationReader(directory).read_metadata().state_dict_metadata
    fresh = _state(1, stepped=False)
    assert fresh.optimizer is not None
    names = parameter_names(fresh.model)
    assert set(names) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    partial = {k: v for k, v in entries.items() if not k.startswith("optim.state.2.bias.")}
    assert not shape_from_checkpoint(fresh.model, fresh.optimizer, partial)
    assert not fresh.optimizer.state
    foreign = {**entries, "optim.state.9.weight.exp_avg": entries["optim.state.0.weight.exp_avg"]}
    assert not shape_from_checkpoint(fresh.model, fresh.optimizer, foreign)
    assert not fresh.optimizer.state
    assert shape_from_checkpoint(fresh.model, fresh.optimizer, entries)
    first = fresh.optimizer.state[fresh.model[0].weight]
    assert set(first) == {"step", "exp_avg", "exp_avg_sq"} and first["exp_avg"].shape == (6, 6)
    assert first["step"].dim() == 0
    # a wrapper's attribute is no part of a parameter's name
    wrapped = torch.nn.Module()
    wrapped.module = fresh.model
    assert set(parameter_names(wrapped)) == set(names)


def test_a_failed_or_empty_restore_leaves_no_optimizer_state(tmp_path: Path) -> None:
    saved = _state(0, stepped=True)
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(1, saved)
    # a model of another shape: the shaping declines, the load refuses; no state is left
    other = TrainState(torch.nn.Sequential(torch.nn.Linear(6, 3)), None)
    other.optimizer = torch.optim.Adam(other.model.parameters())
    with pytest.raises(CheckpointMismatchError):
        Checkpointer(f"file://{tmp_path}/ckpt").restore(other)
    assert not other.optimizer.state
    # nothing committed: a fresh start, no state
    fresh = _state(1, stepped=False)
    assert fresh.optimizer is not None
    result = Checkpointer(f"file://{tmp_path}/empty").restore(fresh)
    assert result.source is RestoreSource.NONE and not fresh.optimizer.state


def test_a_buffer_stream_reads_seeks_and_reads_all_without_copying_the_buffer() -> None:
    data = bytearray(b"0123456789")
    stream = BufferStream(data)
    stream.seek(3)
    assert stream.read(2) == b"34" and stream.tell() == 5
    data[5] = ord("X")  # the stream reads the buffer itself, not a copy of it
    assert stream.read() == b"X6789" and stream.read() == b""
    stream.seek(-2, io.SEEK_END)
    assert stream.read(-1) == b"89"
    stream.seek(0)
    assert stream.readall() == bytes(data)
    with pytest.raises(ValueError, match="negative"):
        stream.seek(-1)


def test_another_kind_of_optimizer_is_not_shaped_and_the_load_says_so(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    sgd.step()
    Checkpointer(f"file://{tmp_path}/ckpt").save_now(1, TrainState(model, sgd))
    info = Checkpointer(f"file://{tmp_path}/ckpt").latest()
    assert info is not None
    directory = Location.from_url(f"file://{tmp_path}/ckpt/{info.name}")
    entries = LocationReader(directory).read_metadata().state_dict_metadata
    fresh = _state(1, stepped=False)  # Adam: its groups have other keys than SGD's
    assert fresh.optimizer is not None
    assert not shape_from_checkpoint(fresh.model, fresh.optimizer, entries)
    with pytest.raises(CheckpointMismatchError, match="different model or optimizer"):
        Checkpointer(f"file://{tmp_path}/ckpt").restore(fresh)
    assert not fresh.optimizer.state
