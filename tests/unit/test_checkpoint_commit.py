"""Commit protocol and retention, in one process over memory:// and file://.

A checkpoint counts only with a complete manifest; retention keeps the newest
N committed checkpoints, removes dead directories, and never touches the
newest committed one.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from checkpoint import Checkpointer, RestoreSource, TrainState
from checkpoint.api import MANIFEST_NAME
from checkpoint.commit import list_checkpoints, step_dir_name
from checkpoint.fsspec_storage import Location
from checkpoint.retention import apply_retention

pytestmark = pytest.mark.unit


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "memory":
        return f"memory://unit-{uuid.uuid4().hex[:8]}/ckpt"
    return f"file://{tmp_path}/ckpt"


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return TrainState(model, optimizer, samples_seen=10)


def _dead_save(root: Location, step: int, token: str) -> Location:
    """A directory left by a save that crashed before its manifest."""
    directory = root.child(step_dir_name(step, token))
    directory.fs.makedirs(directory.root, exist_ok=True)
    directory.fs.pipe_file(directory.path("__0_0.distcp"), b"partial")
    return directory


def _committed(ckpt: Checkpointer) -> list[int]:
    return [i.step for i in ckpt.list() if i.committed]


def test_latest_is_the_newest_committed(url: str) -> None:
    ckpt = Checkpointer(url, keep=5)
    for step in (3, 1, 2):
        ckpt.save_now(step, _state())
    latest = ckpt.latest()
    assert latest is not None and latest.step == 3
    assert latest.manifest is not None
    assert latest.manifest.samples_seen == 10
    assert {o.path for o in latest.manifest.objects} == {".metadata", "__0_0.distcp"}
    assert ckpt.verify(latest).ok


def test_directory_without_manifest_does_not_count(url: str) -> None:
    ckpt = Checkpointer(url, keep=5)
    ckpt.save_now(1, _state())
    _dead_save(ckpt.root, 9, "deadbeef")
    infos = ckpt.list()
    assert [(i.step, i.committed) for i in infos] == [(1, True), (9, False)]
    assert ckpt.latest() is not None and ckpt.latest().step == 1  # type: ignore[union-attr]


def test_manifest_listing_a_missing_or_short_object_does_not_count(url: str) -> None:
    ckpt = Checkpointer(url, keep=5)
    ckpt.save_now(1, _state())
    ckpt.save_now(2, _state())
    two = ckpt.latest()
    assert two is not None
    directory = ckpt.root.child(two.name)
    data = directory.fs.cat_file(directory.path("__0_0.distcp"))
    directory.fs.pipe_file(directory.path("__0_0.distcp"), data[:-1])
    info = next(i for i in ckpt.list() if i.step == 2)
    assert not info.committed and "bytes" in (info.problem or "")
    directory.fs.rm_file(directory.path("__0_0.distcp"))
    info = next(i for i in ckpt.list() if i.step == 2)
    assert not info.committed and "missing" in (info.problem or "")
    assert ckpt.latest().step == 1  # type: ignore[union-attr]


def test_restore_round_trip_in_one_process(url: str) -> None:
    ckpt = Checkpointer(url, keep=2)
    saved = _state(seed=0)
    saved.extra["note"] = "hello"
    ckpt.save_now(5, saved)
    fresh = _state(seed=1)
    result = ckpt.restore(fresh)
    assert result.source is RestoreSource.DURABLE and result.step == 5
    assert fresh.samples_seen == 10 and fresh.extra == {"note": "hello"}
    for a, b in zip(saved.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert saved.optimizer is not None and fresh.optimizer is not None
    ms = [saved.optimizer.state[p]["momentum_buffer"] for p in saved.model.parameters()]
    mf = [fresh.optimizer.state[p]["momentum_buffer"] for p in fresh.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(ms, mf, strict=True))


def test_nothing_to_restore_is_a_fresh_start(url: str) -> None:
    result = Checkpointer(url).restore(_state())
    assert result.source is RestoreSource.NONE and result.step is None


def test_retention_keeps_newest_and_cleans_dead_directories(url: str) -> None:
    ckpt = Checkpointer(url, keep=2)
    root = ckpt.root
    dead_old = _dead_save(root, 2, "0badf00d")
    for step in (1, 3, 4, 5):
        ckpt.save_now(step, _state())
    names = [i.name for i in list_checkpoints(root)]
    assert [i.step for i in list_checkpoints(root)] == [4, 5]
    assert dead_old.root.rsplit("/", 1)[-1] not in names


def test_retention_never_deletes_the_last_committed(url: str) -> None:
    root = Location.from_url(url)
    ckpt = Checkpointer(url, keep=1)
    ckpt.save_now(1, _state())
    # Newer directories that never committed (crashed saves) must not count.
    _dead_save(root, 2, "aa")
    _dead_save(root, 3, "bb")
    result = apply_retention(root, keep=1)
    assert result.kept == (ckpt.latest().name,)  # type: ignore[union-attr]
    assert result.deleted == ()
    assert [i.step for i in list_checkpoints(root) if i.committed] == [1]
    # gc may remove the dead newer ones, still never the committed one.
    gc = apply_retention(root, keep=1, all_uncommitted=True)
    assert len(gc.cleaned) == 2
    assert [(i.step, i.committed) for i in list_checkpoints(root)] == [(1, True)]
    with pytest.raises(ValueError, match="keep"):
        apply_retention(root, keep=0)


def test_deleting_an_old_checkpoint_removes_its_manifest_first(url: str) -> None:
    ckpt = Checkpointer(url, keep=1)
    ckpt.save_now(1, _state())
    first = ckpt.latest()
    assert first is not None
    ckpt.save_now(2, _state())
    assert not ckpt.root.fs.exists(ckpt.root.child(first.name).path(MANIFEST_NAME))
    assert _committed(ckpt) == [2]


def test_unusable_storage_is_reported_before_training(tmp_path: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    from checkpoint import CheckpointStorageError

    with pytest.raises(CheckpointStorageError, match="not usable"):
        Checkpointer(f"file://{blocker}/ckpt")


def test_catalog_functions_take_urls(url: str) -> None:
    from checkpoint import catalog

    ckpt = Checkpointer(url, keep=5)
    ckpt.save_now(1, _state())
    ckpt.save_now(2, _state())
    assert [i.step for i in catalog.checkpoints(url)] == [1, 2]
    newest = catalog.latest(url)
    assert newest is not None and newest.step == 2
    assert catalog.verify(url).ok
    assert catalog.verify(newest.url).url == newest.url
    oldest = catalog.checkpoints(url)[0].name
    assert catalog.gc(url, keep=1).deleted == (oldest,)
    assert [i.step for i in catalog.checkpoints(url)] == [2]
