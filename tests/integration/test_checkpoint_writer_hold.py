"""The writer marker on real stores (file:// and the moto S3 server): taken exclusively,
renewed, refused to another live run, taken over when stale, released only by its own.

Each run is a :class:`WriterHold` of its own lineage, with a clock the test sets,
so a heartbeat's age is chosen rather than waited for.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from orchestrator.checkpoint_root.api import RootHeldError
from orchestrator.checkpoint_root.writer_hold import (
    HeldRoot,
    HoldState,
    MarkerStore,
    WriterHold,
    refuse_if_held,
    release_store,
)
from orchestrator.checkpoint_root.writer_marker import STALE_AFTER_S, WriterMarker

pytestmark = pytest.mark.integration

T0 = 1_764_000_000.0
RUN_A = "train-gpt@1764000000.000000"
RUN_B = "train-gpt@1764000042.500000"


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "file":
        return f"file://{tmp_path}/ckpt", {}
    s3 = request.getfixturevalue("s3")
    return s3.url(f"writer-{uuid.uuid4().hex[:8]}"), s3.storage_options


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _hold(
    target: tuple[str, dict[str, Any]], run_id: str, clock: Clock, pid: int = 100
) -> WriterHold:
    url, options = target
    mine = WriterMarker(
        run_id, uuid.uuid4().hex[:16], "train-gpt", 1, "box-a", pid, "127.0.0.1:2379", 0.0, 0.0
    )
    return WriterHold(MarkerStore(url, options), mine, clock)


def test_one_live_writer_and_a_stale_one_taken_over(target: tuple[str, dict[str, Any]]) -> None:
    clock = Clock()
    a, b = _hold(target, RUN_A, clock, pid=1), _hold(target, RUN_B, clock, pid=2)
    assert a.acquire() is None
    assert a.store.read() == a.mine

    clock.now += STALE_AFTER_S / 2
    assert a.refresh() is None
    assert a.store.read().heartbeat_at == clock.now  # type: ignore[union-attr]
    with pytest.raises(RootHeldError) as refused:
        b.acquire()
    assert RUN_A in str(refused.value) and "controller pid 1 on host box-a" in str(refused.value)
    assert a.store.read() == a.mine  # the refused run wrote nothing

    a_standby = _hold(target, RUN_A, clock, pid=3)  # a standby of the same lineage
    assert a_standby.acquire() is None
    assert a.refresh() is None  # still its lineage's root

    clock.now += STALE_AFTER_S + 1  # A's controllers were SIGKILLed
    note = b.acquire()
    assert note is not None and "took over" in note and RUN_A in note
    assert b.store.read() == b.mine
    lost = a.refresh()  # A comes back: another run writes there now, A stops
    assert lost is not None and RUN_B in lost
    assert b.store.read() == b.mine

    assert not a.release()  # not A's to remove
    assert not release_store(b.store, RUN_B, token="another-holder")
    assert b.release()
    assert b.store.read() is None


def test_exclusive_create_and_the_checks_before_a_run(target: tuple[str, dict[str, Any]]) -> None:
    url, options = target
    clock = Clock()
    first, second = _hold(target, RUN_A, clock), _hold(target, RUN_B, clock)
    first.mine = first.mine.beat(clock.now)
    second.mine = second.mine.beat(clock.now)
    assert first.store.create(first.mine)
    assert not second.store.create(second.mine)  # exists: not overwritten
    assert second.store.read() == first.mine

    first.store.replace(first.mine.beat(clock.now - STALE_AFTER_S - 1))
    refuse_if_held(url, options)  # stale: the run starts, its controller takes it over
    first.store.replace(first.mine.beat(time.time()))  # refuse_if_held reads the real clock
    with pytest.raises(RootHeldError, match="is being written by another run"):
        refuse_if_held(url, options)


def test_a_controllers_hold_renews_and_releases(target: tuple[str, dict[str, Any]]) -> None:
    hold = _hold(target, RUN_A, Clock())
    hold.clock = _Ticking()
    held = HeldRoot(hold, refresh_s=0.05)
    held.start(wait=30)
    assert held.state is HoldState.HELD and held.note is None
    beats = set()
    while len(beats) < 3:  # the thread renews on its own
        marker = hold.store.read()
        assert marker is not None
        beats.add(marker.heartbeat_at)
    held.close(release=True)
    held.join(30)
    assert hold.store.read() is None

    other = _hold(target, RUN_B, Clock())
    other.clock = _Ticking()
    assert other.acquire() is None
    refused = HeldRoot(_hold(target, RUN_A, Clock()))
    refused.hold.clock = _Ticking()
    refused.start(wait=30)
    assert refused.state is HoldState.REFUSED and RUN_B in (refused.message or "")


class _Ticking:
    """Wall-clock time that moves on by a millisecond at each reading."""

    def __init__(self) -> None:
        self.now = T0 + 10**6

    def __call__(self) -> float:
        self.now += 0.001
        return self.now
