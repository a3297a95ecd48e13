"""Object checksums: CRC-32C for new checkpoints, older CRC-32 manifests still verify.

Over file:// (and memory:// for the streamed path) in one process.  A
checkpoint written now names ``crc32c``; on a local disk the checksum is
read back from the file while it is fsynced, and equals the one streamed
to other filesystems; a failed fsync fails the save; one rewritten to look
like an older checkpoint (``crc32`` manifest) still verifies and still
catches a flipped byte; an unknown algorithm is refused by name.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import uuid
import zlib
from typing import Any

import pytest
import torch

from checkpoint import Checkpointer, TrainState, checksums, fsspec_storage
from checkpoint.api import (
    MANIFEST_NAME,
    CheckpointCorruptError,
    CheckpointStorageError,
    ObjectEntry,
)
from checkpoint.checksums import KNOWN_ALGORITHMS, checksum_hex, new_checksum
from checkpoint.commit import read_manifest, verify_checkpoint, write_manifest
from checkpoint.fsspec_storage import Location, torch_zip_crc_off
from checkpoint.manifest import encode_manifest

pytestmark = pytest.mark.unit


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    return TrainState(model, torch.optim.Adam(model.parameters()), samples_seen=5)


def test_crc32c_matches_the_standard_check_value() -> None:
    # The CRC-32C check value of "123456789" (RFC 3720, appendix B.4).
    assert checksum_hex(b"123456789", "crc32c") == "e3069283"
    assert checksum_hex(b"123456789", "crc32") == f"{zlib.crc32(b'123456789'):08x}"


def test_streamed_checksum_equals_one_shot_over_writable_views() -> None:
    data = torch.arange(3 << 20, dtype=torch.uint8).numpy().tobytes()
    running = new_checksum("crc32c")
    view = memoryview(bytearray(data))  # writable, like a tensor's memory
    running.update(view[:1000])
    running.update(view[1000 : (2 << 20) + 7])
    running.update(view[(2 << 20) + 7 :])
    assert running.size == len(data)
    assert running.hexdigest() == checksum_hex(data, "crc32c")


def test_copying_fallback_gives_the_same_checksum(monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.randn(300_000).numpy().tobytes()
    direct = new_checksum("crc32c")
    direct.update(memoryview(bytearray(data)))
    monkeypatch.setattr(checksums, "_extend_view", None)  # as if the library were elsewhere
    copied = new_checksum("crc32c")
    copied.update(memoryview(bytearray(data)))
    assert direct.hexdigest() == copied.hexdigest() == checksum_hex(data, "crc32c")


def test_combined_crc32c_of_two_parts_is_that_of_the_whole() -> None:
    whole = torch.randint(0, 256, (70_001,), dtype=torch.uint8).numpy().tobytes()
    for cut in (0, 1, 8, 4095, 65_536, len(whole)):
        a, b = whole[:cut], whole[cut:]
        combined = checksums.crc32c_combine(
            int(checksum_hex(a, "crc32c"), 16), int(checksum_hex(b, "crc32c"), 16), len(b)
        )
        assert f"{combined:08x}" == checksum_hex(whole, "crc32c"), cut


def test_a_buffer_checksummed_in_pieces_on_threads_equals_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checksums, "PARALLEL_PIECE_BYTES", 1 << 16)  # pieces at a test's size
    data = torch.randint(0, 256, ((1 << 18) + 13,), dtype=torch.uint8).numpy().tobytes()
    one_pass = checksum_hex(data, "crc32c")
    for threads in (2, 3, 4):
        assert checksums.checksum_buffer(data, "crc32c", threads) == (len(data), one_pass)
        view = memoryview(bytearray(data))  # a mapping or a tensor's memory
        assert checksums.checksum_buffer(view, "crc32c", threads) == (len(data), one_pass)
    # CRC-32 (older manifests) and small buffers take one pass
    assert checksums.checksum_buffer(data, "crc32", 4)[1] == checksum_hex(data, "crc32")
    assert checksums.checksum_buffer(data[:100], "crc32c", 4) == (100, checksum_hex(data[:100]))


def test_unknown_algorithm_is_named() -> None:
    with pytest.raises(ValueError, match=r"sha1.*known: crc32, crc32c"):
        new_checksum("sha1")


def test_new_checkpoints_name_crc32c_and_verify(tmp_path: Any) -> None:
    ckpt = Checkpointer(f"file://{tmp_path}/ck")
    manifest = ckpt.save_now(1, _state())
    assert manifest.checksum_algorithm == "crc32c"
    info = ckpt.latest()
    assert info is not None
    assert ckpt.verify(info).ok
    ckpt.close()


def _data_objects(ckpt: Checkpointer) -> dict[str, tuple[int, str]]:
    info = ckpt.latest()
    assert info is not None and info.manifest is not None
    return {
        o.path: (o.size, o.checksum) for o in info.manifest.objects if o.path.endswith(".distcp")
    }


def test_local_checksums_come_from_the_file_and_equal_streamed_ones(tmp_path: Any) -> None:
    # One writer thread: with two, which tensors share a file depends on thread timing
    # (seen failing under load), and then the two saves' objects differ.
    local = Checkpointer(f"file://{tmp_path}/ck", thread_count=1)
    streamed = Checkpointer(f"memory://sums-{uuid.uuid4().hex[:8]}/ck", thread_count=1)
    state = _state()
    local.save_now(1, state)
    streamed.save_now(1, state)
    on_disk = _data_objects(local)
    assert len(on_disk) == 1  # one object per writer thread
    # The same tensors serialise to the same bytes: read back or streamed, same sums.
    assert on_disk == _data_objects(streamed)
    info = local.latest()
    assert info is not None
    for path, (size, crc) in on_disk.items():
        assert (size, crc) == local.root.child(info.name).checksum_object(
            str(tmp_path / "ck" / info.name / path)
        )
    local.close()
    streamed.close()


def test_failed_fsync_fails_the_save_and_commits_nothing(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpointer(f"file://{tmp_path}/ck")

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fsspec_storage.os, "fsync", failing_fsync)
    with pytest.raises(CheckpointStorageError, match=r"failed: rank 0: OSError: .*Input/output"):
        ckpt.save_now(1, _state())
    monkeypatch.undo()
    assert ckpt.latest() is None
    assert all(not info.committed for info in ckpt.list())


def test_read_back_refuses_a_file_shorter_than_what_was_written(tmp_path: Any) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="holds 100 bytes after writing 120"):
            fsspec_storage._checksum_of_file(fd, 120)
        assert fsspec_storage._checksum_of_file(fd, 100) == checksum_hex(b"x" * 100)
    finally:
        os.close(fd)


def _as_crc32_manifest(directory: Location) -> None:
    """Rewrite a manifest as an older version wrote it: CRC-32 object checksums."""
    manifest = read_manifest(directory)
    objects = []
    for obj in manifest.objects:
        size, crc = directory.checksum_object(directory.path(obj.path), "crc32")
        objects.append(ObjectEntry(obj.path, size, crc))
    old = dataclasses.replace(manifest, objects=tuple(objects), checksum_algorithm="crc32")
    write_manifest(directory, old)


def test_older_crc32_manifest_still_verifies_and_catches_damage(tmp_path: Any) -> None:
    ckpt = Checkpointer(f"file://{tmp_path}/ck")
    ckpt.save_now(1, _state())
    info = ckpt.latest()
    assert info is not None
    directory = ckpt.root.child(info.name)
    _as_crc32_manifest(directory)
    assert read_manifest(directory).checksum_algorithm == "crc32"
    assert verify_checkpoint(directory).ok

    victim = next(o.path for o in read_manifest(directory).objects if o.path.endswith(".distcp"))
    path = tmp_path / "ck" / info.name / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    report = verify_checkpoint(directory)
    assert not report.ok
    assert any(victim in p and "checksum" in p for p in report.problems)
    ckpt.close()


def test_manifest_with_unknown_algorithm_says_to_upgrade(tmp_path: Any) -> None:
    ckpt = Checkpointer(f"file://{tmp_path}/ck")
    ckpt.save_now(1, _state())
    info = ckpt.latest()
    assert info is not None and info.manifest is not None
    directory = ckpt.root.child(info.name)
    future = dataclasses.replace(info.manifest, checksum_algorithm="blake9")
    (tmp_path / "ck" / info.name / MANIFEST_NAME).write_bytes(encode_manifest(future))
    with pytest.raises(CheckpointCorruptError, match=r"'blake9'.*upgrade ringmaster"):
        read_manifest(directory)
    # Listing reports it as not committed, with the reason.
    listed = ckpt.list()[-1]
    assert not listed.committed and "blake9" in (listed.problem or "")
    assert (
        json.loads((tmp_path / "ck" / info.name / MANIFEST_NAME).read_bytes())["checksum_algorithm"]
        == "blake9"
    )
    assert set(KNOWN_ALGORITHMS) == {"crc32", "crc32c"}
    ckpt.close()


def test_zip_crc_switch_is_scoped_and_nests() -> None:
    assert torch.serialization.get_crc32_options()
    with torch_zip_crc_off():
        with torch_zip_crc_off():
            assert not torch.serialization.get_crc32_options()
        assert not torch.serialization.get_crc32_options()
        buf = io.BytesIO()
        torch.save(torch.arange(10), buf)  # written without record CRCs...
        buf.seek(0)
        assert torch.equal(torch.load(buf), torch.arange(10))  # ...and still loads
    assert torch.serialization.get_crc32_options()
