"""Typed records: every stored value round-trips, and a bad one is an error naming its key."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from orchestrator.api import JobPhase
from orchestrator.observe.records import RecoveryRecord
from orchestrator.state import records
from orchestrator.state.api import RecordError
from orchestrator.state.records import (
    BreakReport,
    JobStatus,
    Member,
    NodeRecord,
    Plan,
    ProgressRecord,
    ResumeRequest,
    SpecRecord,
    Telemetry,
)

pytestmark = pytest.mark.unit

KEY = "/ringmaster/jobs/j/progress/n-0"


def _progress() -> ProgressRecord:
    return ProgressRecord(
        step=7,
        generation=2,
        rank=1,
        world_size=2,
        pid=99,
        beat=10.5,
        step_time=9.0,
        metrics={"loss": 0.25},
        telemetry=Telemetry(generation=2, first_step_at=8.0, wire_bytes=10),
    )


EXAMPLES: list[records.Record] = [
    _progress(),
    Plan(3, [Member("a", 0, 2, {"rack": "r1"}), Member("b", 2, 2)], ["c"], "b replaces x"),
    NodeRecord("h", "10.0.0.1", 2, 5, [6, 7], 1.0, {"rack": "r1"}, "10.0.0.1:4000"),
    BreakReport(step=5, reason="peer gone", planned=False, at=2.0, user_error=True),
    JobStatus("j", JobPhase.RECOVERING, step=4, failed_nodes=["b"], last_recovery={"x": 1}),
    SpecRecord({"name": "j"}, "abc", 1.0, ResumeRequest("file:///c", 4, 2)),
    records.LogChunk("n", 0, [(1.0, "hello"), (2.0, "world")]),
    RecoveryRecord(2, "agent_gone", ["a"], "why", 1.0, 2.0, 3.0, 4.0, 5.0),
]


@pytest.mark.parametrize("record", EXAMPLES, ids=[type(r).__name__ for r in EXAMPLES])
def test_round_trip(record: records.Record) -> None:
    text = record.encode()
    assert json.loads(text)["v"] == records.FORMAT
    assert records.decode(type(record), text, KEY) == record


def test_a_missing_field_names_the_key_and_the_field() -> None:
    data = _progress().to_dict()
    del data["beat"]
    with pytest.raises(RecordError, match=rf"^{KEY}: ProgressRecord is missing the field 'beat'"):
        records.decode(ProgressRecord, json.dumps(data), KEY)


def test_a_wrong_type_names_the_field() -> None:
    data = _progress().to_dict()
    data["telemetry"]["wire_bytes"] = "ten"
    with pytest.raises(RecordError, match=rf"{KEY}: telemetry: wire_bytes: expected an integer"):
        records.decode(ProgressRecord, json.dumps(data), KEY)
    data = _progress().to_dict()
    data["step"] = True
    with pytest.raises(RecordError, match="step: expected an integer, got bool"):
        records.decode(ProgressRecord, json.dumps(data), KEY)


def test_unversioned_newer_and_non_json_values_are_refused() -> None:
    data = _progress().to_dict()
    del data["v"]
    with pytest.raises(RecordError, match="no format version"):
        records.decode(ProgressRecord, json.dumps(data), KEY)
    data["v"] = records.FORMAT + 1
    with pytest.raises(RecordError, match="newer than this ringmaster reads"):
        records.decode(ProgressRecord, json.dumps(data), KEY)
    with pytest.raises(RecordError, match=f"{KEY}: not JSON"):
        records.decode(ProgressRecord, b"{oops", KEY)
    with pytest.raises(RecordError, match=f"{KEY}: no ProgressRecord stored there"):
        records.decode(ProgressRecord, None, KEY)


def test_an_unknown_phase_lists_the_valid_ones() -> None:
    data = JobStatus("j").to_dict()
    data["phase"] = "Sleeping"
    with pytest.raises(RecordError, match="phase: 'Sleeping' is not one of Pending, Running"):
        records.decode(JobStatus, json.dumps(data), "/s")


def test_every_record_type_is_exported_and_a_dataclass() -> None:
    exported = [getattr(records, n) for n in records.__all__]
    kinds = [k for k in exported if isinstance(k, type) and issubclass(k, records.Record)]
    assert len(kinds) >= 17
    for kind in kinds:
        if kind is records.Record:
            continue
        assert dataclasses.is_dataclass(kind), kind
        typing.get_type_hints(kind)  # every annotation resolves


def test_types_worked_out_once_still_check_every_later_decode() -> None:
    """The per-class schema is cached: a good decode must not let a later bad one pass."""
    good = _progress().to_dict()
    for _ in range(3):
        assert records.decode(ProgressRecord, json.dumps(good), KEY) == _progress()
    bad = {**good, "generation": "two"}
    with pytest.raises(RecordError, match="generation: expected an integer, got str"):
        records.decode(ProgressRecord, json.dumps(bad), KEY)
    # another class sharing a field name has its own schema: defaults, its own types
    assert records.decode(Telemetry, json.dumps({"v": records.FORMAT}), KEY) == Telemetry()
    with pytest.raises(RecordError, match="wire_bytes: expected an integer, got float"):
        records.decode(Telemetry, json.dumps({"v": records.FORMAT, "wire_bytes": 1.5}), KEY)
