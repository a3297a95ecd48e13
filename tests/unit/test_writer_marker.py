"""The writer marker's decision, without a store: free, ours, live or stale, and the lines
that refuse a second writer, warn of a takeover and stop a run that lost its root."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.checkpoint_root.writer_hold import root_url, shown
from orchestrator.checkpoint_root.writer_marker import (
    STALE_AFTER_S,
    Holding,
    WriterMarker,
    judge,
    refusal,
)

pytestmark = pytest.mark.unit

NOW = 1_764_000_100.0
URL = "s3://bucket/train-gpt"


def _marker(age: float, run_id: str = "train-gpt@1764000000.000000") -> WriterMarker:
    return WriterMarker(
        run_id=run_id,
        token="a1b2c3d4e5f60718",
        job="train-gpt",
        run=1,
        host="box-a",
        pid=4242,
        etcd="127.0.0.1:23790",
        heartbeat_at=NOW - age,
        acquired_at=NOW - 60,
    )


MINE = "train-gpt@1764000042.500000"


@pytest.mark.parametrize(
    ("marker", "run_id", "expected"),
    [
        pytest.param(None, MINE, Holding.FREE, id="no marker"),
        pytest.param(None, None, Holding.FREE, id="no marker, before the run has a lineage"),
        pytest.param(_marker(2.0), MINE, Holding.LIVE, id="another run, fresh heartbeat"),
        pytest.param(_marker(STALE_AFTER_S), MINE, Holding.LIVE, id="another run, at the limit"),
        pytest.param(_marker(STALE_AFTER_S + 0.1), MINE, Holding.STALE, id="another run, stale"),
        pytest.param(_marker(-5.0), MINE, Holding.LIVE, id="a heartbeat from a clock ahead"),
        pytest.param(_marker(2.0, MINE), MINE, Holding.OURS, id="our lineage, fresh"),
        pytest.param(_marker(3600.0, MINE), MINE, Holding.OURS, id="our lineage, stale"),
        pytest.param(_marker(2.0), None, Holding.LIVE, id="fresh, reader without lineage"),
        pytest.param(_marker(3600.0), None, Holding.STALE, id="stale, reader without lineage"),
    ],
)
def test_judge(marker: WriterMarker | None, run_id: str | None, expected: Holding) -> None:
    assert judge(marker, run_id, NOW) is expected


def test_the_holders_own_limit_decides() -> None:
    patient = replace(_marker(100.0), stale_after_s=300.0)
    assert judge(patient, MINE, NOW) is Holding.LIVE
    assert judge(patient.beat(NOW - 301.0), MINE, NOW) is Holding.STALE


def test_round_trip_and_unreadable_markers() -> None:
    marker = _marker(1.0)
    assert WriterMarker.decode(marker.encode()) == marker
    for garbage in (b"", b"{not json", b"[]", b'{"run_id": "x"}', b"\xff\xfe"):
        unreadable = WriterMarker.decode(garbage)
        assert judge(unreadable, MINE, NOW) is Holding.STALE, garbage


def test_refusal_is_one_line_naming_the_other_run_and_what_to_do() -> None:
    line = refusal(_marker(2.0), URL, NOW)
    assert "\n" not in line
    for part in (
        URL,
        "train-gpt@1764000000.000000",
        "run 1 of job 'train-gpt'",
        "controller pid 4242 on host box-a",
        "last heartbeat 2.0s ago",
        f"{STALE_AFTER_S:g}s old, in 28s",
        "`ringmaster stop train-gpt --etcd 127.0.0.1:23790`",
        "another checkpoint.url",
    ):
        assert part in line, (part, line)


def test_urls_as_shown_and_as_read_from_a_directory() -> None:
    assert shown("s3://key:secret@bucket/x") == "s3://***@bucket/x"
    assert root_url("ckpt", "/data/run") == "file:///data/run/ckpt"
    assert root_url("file://./checkpoints", "/data/run") == "file:///data/run/checkpoints"
    assert root_url("file:///data/ckpt/", "/data/run") == "file:///data/ckpt"
    assert root_url(URL, "/work") == URL
