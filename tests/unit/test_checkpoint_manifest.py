"""Manifest encoding: round trip, and every damaged form refuses to parse as a commit."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from checkpoint.api import CheckpointCorruptError, Manifest, ObjectEntry
from checkpoint.manifest import crc32_hex, decode_manifest, encode_manifest, job_spec_hash

pytestmark = pytest.mark.unit


def _manifest() -> Manifest:
    return Manifest(
        step=42,
        world_size=2,
        job_spec_hash="abc",
        created_at=1700000000.5,
        objects=(
            ObjectEntry(".metadata", 10, crc32_hex(b"0123456789")),
            ObjectEntry("__0_0.distcp", 3, crc32_hex(b"abc")),
        ),
        samples_seen=336,
    )


def test_round_trip() -> None:
    m = _manifest()
    assert decode_manifest(encode_manifest(m)) == m
    assert m.total_bytes == 13


def test_run_id_round_trips_and_is_absent_when_unknown() -> None:
    m = _manifest()
    assert "run_id" not in json.loads(encode_manifest(m))  # written as before runs had ids
    named = Manifest(**{**m.__dict__, "run_id": "job/run-2/1764000000.0"})
    assert decode_manifest(encode_manifest(named)) == named
    raw = json.loads(encode_manifest(named))
    raw["run_id"] = 7
    body = {k: v for k, v in raw.items() if k != "self_checksum"}
    raw["self_checksum"] = crc32_hex(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    )
    with pytest.raises(CheckpointCorruptError, match="run_id 7 is not text"):
        decode_manifest(json.dumps(raw).encode())


def test_truncated_manifest_is_not_a_commit() -> None:
    data = encode_manifest(_manifest())
    for cut in (0, 1, len(data) // 2, len(data) - 2):
        with pytest.raises(CheckpointCorruptError):
            decode_manifest(data[:cut])


def test_edited_manifest_fails_its_self_checksum() -> None:
    raw = json.loads(encode_manifest(_manifest()))
    raw["step"] = 43
    with pytest.raises(CheckpointCorruptError, match="self-checksum"):
        decode_manifest(json.dumps(raw).encode())


def test_newer_format_says_to_upgrade() -> None:
    m = _manifest()
    newer = Manifest(**{**m.__dict__, "format": 99})
    with pytest.raises(CheckpointCorruptError, match="upgrade"):
        decode_manifest(encode_manifest(newer))


@dataclass
class _Spec:
    name: str
    nodes: dict[str, int] = field(default_factory=lambda: {"min": 1, "max": 2})


def test_job_spec_hash_is_stable_and_sensitive() -> None:
    assert job_spec_hash(_Spec("a")) == job_spec_hash(_Spec("a"))
    assert job_spec_hash(_Spec("a")) != job_spec_hash(_Spec("b"))
    assert len(job_spec_hash({"x": 1})) == 16
