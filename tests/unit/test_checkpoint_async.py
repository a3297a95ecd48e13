"""Asynchronous save semantics: the handle, skip-while-busy, and owner assignment.

The upload is held back by a real filesystem whose writes wait on an event,
so "still uploading" is a state the test controls rather than a race.
"""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import timedelta
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from checkpoint import (
    Checkpointer,
    CheckpointTimeoutError,
    RetryableCheckpointError,
    SaveHandle,
    SaveStatus,
    TrainState,
)
from checkpoint.flat_state import (
    EVERY_RANK,
    WRITERS,
    assign_owners,
    capture,
    nbytes,
    owned_keys,
    rank_key,
    replicated_sizes,
)

pytestmark = pytest.mark.unit


class _GatedFile:
    def __init__(self, raw: Any, gate: threading.Event) -> None:
        self._raw = raw
        self._gate = gate

    def write(self, data: Any) -> int:
        if not self._gate.wait(timeout=30):
            raise OSError("gate never opened")
        return int(self._raw.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> _GatedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._raw.close()


class _GatedMemoryFileSystem(MemoryFileSystem):
    """memory:// whose data-object writes wait until ``gate`` is set."""

    gate = threading.Event()

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        f = super()._open(path, mode, *args, **kwargs)
        if "w" in mode and path.endswith(".distcp"):
            return _GatedFile(f, self.gate)
        return f


def _state() -> TrainState:
    model = torch.nn.Linear(4, 2)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.fixture
def gated() -> tuple[str, fsspec.AbstractFileSystem, threading.Event]:
    gate = threading.Event()
    fs = _GatedMemoryFileSystem(skip_instance_cache=True)
    fs.gate = gate
    return f"memory://async-{uuid.uuid4().hex[:8]}/ckpt", fs, gate


def test_handle_reports_progress_and_timeout(gated: Any) -> None:
    url, fs, gate = gated
    ckpt = Checkpointer(url, filesystem=fs)
    handle = ckpt.save_async(1, _state())
    assert isinstance(handle, SaveHandle)
    assert not handle.done() and handle.status is SaveStatus.STAGED
    with pytest.raises(CheckpointTimeoutError) as err:
        handle.wait(timedelta(seconds=0.05))
    assert isinstance(err.value, RetryableCheckpointError)
    assert ckpt.latest() is None  # nothing committed while uploading
    gate.set()
    manifest = handle.wait(timedelta(seconds=30))
    assert handle.done() and handle.status is SaveStatus.COMMITTED
    assert manifest.step == 1 and ckpt.latest().step == 1


def test_trigger_while_uploading_is_skipped_then_coalesced(
    gated: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url, fs, gate = gated
    ckpt = Checkpointer(url, filesystem=fs, every_steps=2)
    state = _state()
    first = ckpt.maybe_save(2, state)
    assert first is not None
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        assert ckpt.maybe_save(3, state) is None  # not due
        assert ckpt.maybe_save(4, state) is None  # due, but step 2 still uploading
    assert "skipped" in caplog.text and ckpt.saver.skipped == 1
    gate.set()
    first.wait(timedelta(seconds=30))
    # The missed trigger stays pending and fires at the next step.
    later = ckpt.maybe_save(5, state)
    assert later is not None and later.step == 5
    later.wait(timedelta(seconds=30))
    assert [i.step for i in ckpt.list() if i.committed] == [2, 5]


def test_save_now_waits_for_the_save_in_flight(gated: Any) -> None:
    url, fs, gate = gated
    ckpt = Checkpointer(url, filesystem=fs)
    state = _state()
    first = ckpt.save_async(1, state)
    assert first is not None
    threading.Timer(0.2, gate.set).start()
    manifest = ckpt.save_now(2, state, timeout=timedelta(seconds=30))
    assert first.done() and manifest.step == 2


def test_owners_balance_bytes_and_keep_rank_keys_home() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters())
    flat, _ = capture(TrainState(model, optimizer), rank=1)
    owners = assign_owners(flat, world_size=3)
    assert owners[rank_key(1)] == 1
    loads = [0, 0, 0]
    for key, rank in owners.items():
        loads[rank] += nbytes(flat[key])
    biggest = max(nbytes(v) for v in flat.values())
    assert max(loads) - min(loads) <= biggest
    assert assign_owners(flat, 3) == owners  # deterministic


def test_sharded_keys_are_written_by_the_writers_alone_when_there_are_writers() -> None:
    """Under a delayed sync with an FSDP2 model in each site the first site's ranks
    write the replicated keys and their own slices; the other sites' ranks only their
    own blobs (each site holds every slice: one site's make the whole)."""
    owners = {"model.w": WRITERS, "extra": 0, "rank.0": 0, "rank.2": 2}
    assert owned_keys(owners, 0, (0, 1)) == ["model.w", "extra", "rank.0"]
    assert owned_keys(owners, 2, (0, 1)) == ["rank.2"]
    # without writers every rank writes its own slice of each sharded key
    owners["model.w"] = EVERY_RANK
    assert owned_keys(owners, 2) == ["model.w", "rank.2"]


def test_a_pipeline_stages_keys_are_written_by_ranks_that_hold_them() -> None:
    """Stage 0 (ranks 0, 2) holds layer 0, stage 1 (ranks 1, 3) layer 1: each key goes
    to a holder, balanced among them, and every rank computes the same owners."""
    stage0 = torch.nn.Sequential(torch.nn.Linear(64, 64))
    stage1 = torch.nn.Sequential()
    stage1.add_module("1", torch.nn.Linear(64, 8))
    flats = [capture(TrainState(m), rank=r)[0] for r, m in enumerate([stage0, stage1] * 2)]
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for r, flat in enumerate(flats):
        for key, size in replicated_sizes(flat).items():
            holders.setdefault(key, []).append(r)
            sizes[key] = size
    owners = [assign_owners(flat, 4, None, holders, sizes) for flat in flats]
    for r, flat in enumerate(flats):
        for key in replicated_sizes(flat):
            assert owners[r][key] in holders[key], (key, owners[r][key])
            assert all(o[key] == owners[r][key] for o in owners if key in o)
    assert {owners[0]["model.0.weight"], owners[1]["model.1.weight"]} <= {0, 1, 2, 3}
    assert owners[0]["model.0.weight"] != owners[0]["model.0.bias"]  # spread over holders


def test_prepare_allocates_this_ranks_share_before_the_first_save() -> None:
    ckpt = Checkpointer(f"memory://prep-{uuid.uuid4().hex[:8]}/ckpt")
    state = _state()
    assert ckpt.saver._stager.staged_bytes == 0
    ckpt.prepare(state)
    params = sum(p.numel() * p.element_size() for p in state.model.parameters())
    assert ckpt.saver._stager.staged_bytes == params  # SGD without momentum: no optimizer tensors
    handle = ckpt.save_async(1, state)
    assert handle is not None and handle.wait().step == 1


def _buffer_addresses(ckpt: Checkpointer) -> dict[str, int]:
    return {k: b.data_ptr() for k, b in ckpt.saver._stager._buffers.items()}


def test_next_generation_reuses_staging_memory_once_the_old_upload_is_done() -> None:
    url = f"memory://adopt-{uuid.uuid4().hex[:8]}/ckpt"
    state = _state()
    old = Checkpointer(url)
    first = old.save_async(1, state)
    assert first is not None
    first.wait(timedelta(seconds=30))
    addresses = _buffer_addresses(old)
    assert addresses

    new = Checkpointer(url)
    assert new.adopt_staging(old)
    assert old.saver._stager.staged_bytes == 0  # handed over, not shared
    handle = new.save_async(2, state)
    assert handle is not None and handle.wait(timedelta(seconds=30)).step == 2
    assert _buffer_addresses(new) == addresses  # copied into the same memory


def test_buffers_of_an_upload_in_flight_are_never_shared(gated: Any) -> None:
    url, fs, gate = gated
    state = _state()
    old = Checkpointer(url, filesystem=fs)
    uploading = old.save_async(1, state)
    assert uploading is not None and not uploading.done()
    saved = {k: v.clone() for k, v in state.model.state_dict().items()}

    # Another root, so the new saver's retention leaves the old save alone.
    new = Checkpointer(f"{url}-next", filesystem=fs)
    assert not new.adopt_staging(old)
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)  # the next generation trains on
    later = new.save_async(2, state)  # stages step 2 into buffers of its own
    assert later is not None
    assert set(_buffer_addresses(new).values()).isdisjoint(_buffer_addresses(old).values())
    gate.set()
    uploading.wait(timedelta(seconds=30))
    later.wait(timedelta(seconds=30))

    # Step 1 holds step 1's values, not step 2's.
    restored = _state()
    reader = Checkpointer(url, filesystem=fs)
    step_1 = next(i for i in reader.list() if i.step == 1)
    reader.restore(restored, url=f"{url}/{step_1.name}")
    for key, value in restored.model.state_dict().items():
        assert torch.equal(value, saved[key])
