"""Failed saves never look committed; corrupt checkpoints are caught; retention is safe.

* A process SIGKILLed while writing (a data object, or DCP's metadata after
  all data) leaves a directory that is never listed as committed and never
  chosen by resume.
* A filesystem that fails one object on one rank fails the save on every
  rank, with a retryable error, and leaves nothing committed: the failed
  save's directory is removed.
* A flipped byte in a shard is caught by ``verify``, and resume falls back
  to the previous checkpoint.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import uuid
from typing import Any

import pytest
import torch

from checkpoint import Checkpointer, RestoreSource, TrainState
from checkpoint.commit import list_checkpoints
from checkpoint.fsspec_storage import Location
from tests.integration.checkpoint_workers import build, save_then_fault, snapshot

pytestmark = pytest.mark.integration


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
    """A fresh checkpoint root URL and its storage options, per backend."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt", {}
    s3 = request.getfixturevalue("s3")
    return s3.url(f"faults-{uuid.uuid4().hex[:8]}"), s3.storage_options


def _committed_steps(url: str, options: dict[str, Any]) -> list[int]:
    return [i.step for i in list_checkpoints(Location.from_url(url, options)) if i.committed]


def _restore_fresh(url: str, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    model, optimizer, scheduler = build(seed=99)
    result = Checkpointer(url, storage_options=options).restore(
        TrainState(model, optimizer, scheduler)
    )
    return result, snapshot(model, optimizer, scheduler)


@pytest.mark.parametrize("suffix", [".distcp", ".metadata.tmp"], ids=["data", "metadata"])
def test_save_killed_mid_upload_is_never_committed(
    target: tuple[str, dict[str, Any]], suffix: str
) -> None:
    url, options = target
    proc = mp.get_context("spawn").Process(
        target=save_then_fault, args=(0, 1, url, options, suffix, "kill")
    )
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL

    infos = list_checkpoints(Location.from_url(url, options))
    assert [i.step for i in infos if i.committed] == [1]
    dead = [i for i in infos if i.step == 2]
    assert all(not i.committed for i in dead)
    if url.startswith("file://"):
        assert dead and "no manifest" in (dead[0].problem or "")

    result, _ = _restore_fresh(url, options)
    assert result.source is RestoreSource.DURABLE
    assert result.step == 1


def test_faulty_object_on_one_rank_fails_the_save_everywhere(gloo: Any, tmp_path: Any) -> None:
    url = f"file://{tmp_path}/ckpt"
    outcomes = gloo(save_then_fault, 2, url, {}, ".distcp", "error")
    # DCP gathers the failure to every rank; it is reported as retryable storage trouble.
    assert outcomes == ["CheckpointStorageError", "CheckpointStorageError"]
    assert _committed_steps(url, {}) == [1]
    infos = list_checkpoints(Location.from_url(url, {}))
    assert [i.step for i in infos] == [1]  # what the failed save of step 2 wrote is gone


def test_faulty_object_over_backend_single_process(target: tuple[str, dict[str, Any]]) -> None:
    url, options = target
    assert save_then_fault(0, 1, url, options, ".distcp", "error") == "CheckpointStorageError"
    assert _committed_steps(url, options) == [1]
    result, _ = _restore_fresh(url, options)
    assert result.step == 1


def _flip_byte(url: str, options: dict[str, Any], name: str, path: str) -> None:
    root = Location.from_url(url, options)
    obj = root.child(name).path(path)
    data = bytearray(root.fs.cat_file(obj))
    data[len(data) // 2] ^= 0x40
    root.fs.pipe_file(obj, bytes(data))


def test_flipped_byte_caught_by_verify_and_resume_falls_back(
    target: tuple[str, dict[str, Any]],
) -> None:
    url, options = target
    model, optimizer, scheduler = build(seed=0)
    state = TrainState(model, optimizer, scheduler, samples_seen=8)
    ckpt = Checkpointer(url, storage_options=options, keep=5)
    ckpt.save_now(1, state)
    first = snapshot(model, optimizer, scheduler)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    state.samples_seen = 16
    ckpt.save_now(2, state)

    newest = ckpt.latest()
    assert newest is not None and newest.step == 2
    assert ckpt.verify(newest).ok
    _flip_byte(url, options, newest.name, "__0_0.distcp")
    report = ckpt.verify(newest)
    assert not report.ok
    assert any("__0_0.distcp" in p and "checksum" in p for p in report.problems)

    result, restored = _restore_fresh(url, options)
    assert result.step == 1
    assert result.samples_seen == 8
    assert result.skipped and result.skipped[0].startswith(newest.name)
    assert restored == first
