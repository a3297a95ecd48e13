"""DCP's file operations on fsspec: what is recorded, and what a failed write leaves behind.

:class:`checkpoint.fsspec_storage._FsspecObjects` stands in for torch's
private fsspec adapter under DCP's public writer and reader, on real
``file://`` and ``memory://`` filesystems.
"""

from __future__ import annotations

import errno
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from checkpoint import Checkpointer, CheckpointStorageError, TrainState, fsspec_storage
from checkpoint.checksums import checksum_hex
from checkpoint.fsspec_storage import _FsspecObjects

pytestmark = pytest.mark.unit


@pytest.fixture(params=["file", "memory"])
def objects(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[_FsspecObjects, str]:
    if request.param == "file":
        fs = fsspec.filesystem("file")
        root = str(tmp_path)
    else:
        fs = fsspec.filesystem("memory")
        root = f"/storage-{uuid.uuid4().hex[:8]}"
    fs.makedirs(root, exist_ok=True)
    return _FsspecObjects(fs, durable=request.param == "file"), root


def test_writes_are_recorded_and_follow_a_rename(objects: tuple[_FsspecObjects, str]) -> None:
    store, root = objects
    tmp = store.concat_path(root, ".metadata.tmp")
    with store.create_stream(tmp, "wb") as f:
        f.write(b"abc")
        f.write(b"defg")
    assert store.written[tmp] == (7, checksum_hex(b"abcdefg"))
    final = store.concat_path(root, ".metadata")
    store.rename(tmp, final)
    assert store.exists(final) and not store.exists(tmp)
    assert store.written == {final: (7, checksum_hex(b"abcdefg"))}
    with store.create_stream(final, "rb") as f:
        assert f.read() == b"abcdefg"
    assert store.ls(root) == [final]


def test_a_write_that_fails_leaves_no_object(objects: tuple[_FsspecObjects, str]) -> None:
    store, root = objects
    path = store.concat_path(root, "__0_0.distcp")
    with (
        pytest.raises(RuntimeError, match="serialisation broke"),
        store.create_stream(path, "wb") as f,
    ):
        f.write(b"half of it")
        raise RuntimeError("serialisation broke")
    assert not store.exists(path)
    assert path not in store.written


def _state() -> TrainState:
    model = torch.nn.Linear(4, 2)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_failed_fsync_leaves_no_data_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpointer(f"file://{tmp_path}/ck")

    def failing_fsync(fd: int) -> Any:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fsspec_storage.os, "fsync", failing_fsync)
    with pytest.raises(CheckpointStorageError, match="Input/output"):
        ckpt.save_now(1, _state())
    monkeypatch.undo()
    assert list((tmp_path / "ck").rglob("*.distcp")) == []
    assert ckpt.latest() is None
