"""Malformed and truncated checkpoint manifests give a typed error, never garbage.

Random bytes, every truncation and byte flip of a real manifest, and manifests
whose fields were changed *with a matching self-checksum* (so only the field
checks stand between a reader and the bad value) go to
:func:`checkpoint.manifest.decode_manifest`.  It must raise
:class:`CheckpointCorruptError` naming the manifest, or return a manifest
whose every field is what a writer could have produced.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from checkpoint.api import CheckpointCorruptError, Manifest, ObjectEntry
from checkpoint.manifest import _canonical, crc32_hex, decode_manifest, encode_manifest

pytestmark = pytest.mark.unit

WHERE = "s3://bucket/run/step-0000000010-1a2b3c4d/manifest.json"
GOOD = Manifest(
    step=10,
    world_size=2,
    job_spec_hash="0123456789abcdef",
    created_at=1_700_000_000.5,
    objects=(
        ObjectEntry(".metadata", 512, "0badc0de"),
        ObjectEntry("__0_0.distcp", 4096, "12345678"),
        ObjectEntry("rank-1/__1_0.distcp", 4096, "9abcdef0"),
    ),
    samples_seen=1280,
)
ENCODED = encode_manifest(GOOD)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["../x", "/etc/passwd", "a/../../b", "a\\\\b", "a\x00b", "", ".", "a//b"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def decode_or_error(data: bytes) -> Manifest | None:
    try:
        manifest = decode_manifest(data, where=WHERE)
    except CheckpointCorruptError as e:
        assert str(e).startswith(WHERE + ": "), str(e)
        return None
    assert_sane(manifest)
    return manifest


def assert_sane(m: Manifest) -> None:
    assert type(m.step) is int and m.step >= 0
    assert type(m.world_size) is int and m.world_size >= 1
    assert type(m.samples_seen) is int and m.samples_seen >= 0
    assert isinstance(m.job_spec_hash, str)
    assert isinstance(m.created_at, float) and math.isfinite(m.created_at)
    for o in m.objects:
        assert type(o.size) is int and o.size >= 0
        assert len(o.checksum) == 8 and int(o.checksum, 16) >= 0
        parts = o.path.split("/")
        assert o.path and not o.path.startswith("/") and "\\" not in o.path
        assert not set(parts) & {"", ".", ".."}
        assert all(ord(c) >= 32 for c in o.path)


def resealed(body: dict[str, Any]) -> bytes:
    """Manifest bytes for ``body`` with a self-checksum that matches it."""
    return json.dumps(dict(body, self_checksum=crc32_hex(_canonical(body)))).encode()


def body() -> dict[str, Any]:
    raw = json.loads(ENCODED)
    raw.pop("self_checksum")
    return raw  # type: ignore[no-any-return]


def test_the_real_manifest_round_trips() -> None:
    assert decode_manifest(ENCODED, where=WHERE) == GOOD
    assert decode_manifest(resealed(body()), where=WHERE) == GOOD


@given(st.binary(max_size=300))
@example(b"")
@example(b"[]")
@example(b"null")
@example(b"\xff\xfe")
@example(b"[" * 100_000)
@example(b'{"self_checksum": "00000000"}')
def test_random_bytes(data: bytes) -> None:
    decode_or_error(data)


@given(st.integers(min_value=0, max_value=len(ENCODED) - 1))
def test_every_truncation_is_corrupt(length: int) -> None:
    assert decode_or_error(ENCODED[:length]) is None


@given(st.integers(min_value=0, max_value=len(ENCODED) - 1), st.integers(1, 255))
def test_a_changed_byte_is_corrupt_or_harmless(position: int, xor: int) -> None:
    data = bytearray(ENCODED)
    data[position] ^= xor
    got = decode_or_error(bytes(data))
    assert got is None or got == GOOD  # e.g. a space turned into a tab


FIELDS = ["step", "world_size", "job_spec_hash", "created_at", "samples_seen", "format"]
OBJECT_FIELDS = ["path", "size", "checksum"]


@given(
    where=st.sampled_from(FIELDS + [f"objects.{f}" for f in OBJECT_FIELDS] + ["objects"]),
    value=JSON,
)
@example(where="objects.path", value="../../../etc/passwd")
@example(where="objects.path", value="/etc/passwd")
@example(where="objects.path", value="a/./b")
@example(where="step", value=True)
@example(where="step", value=1.5)
@example(where="objects.size", value=-1)
@example(where="created_at", value=math.inf)
@example(where="world_size", value=0)
@example(where="objects", value={"path": "x"})
def test_a_resealed_field_change_is_refused_or_sane(where: str, value: Any) -> None:
    data = body()
    if where.startswith("objects."):
        data["objects"][1][where.split(".", 1)[1]] = value
    else:
        data[where] = value
    try:
        sealed = resealed(data)
    except ValueError:  # a value JSON itself cannot carry (nan is fine; cycles are not)
        return
    decode_or_error(sealed)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("path", "../../../etc/passwd", "relative path"),
        ("path", "/etc/passwd", "relative path"),
        ("size", -1, "size"),
        ("size", True, "size"),
        ("checksum", "xyz", "checksum"),
    ],
)
def test_object_entries_that_used_to_pass(field: str, value: Any, says: str) -> None:
    data = body()
    data["objects"][0][field] = value
    with pytest.raises(CheckpointCorruptError, match=says):
        decode_manifest(resealed(data), where=WHERE)


def test_overflowing_and_deep_values_are_corrupt_not_crashes() -> None:
    data = body()
    data["step"] = math.inf
    with pytest.raises(CheckpointCorruptError, match="step"):
        decode_manifest(resealed(data), where=WHERE)
    with pytest.raises(CheckpointCorruptError, match="not JSON"):
        decode_manifest(b"[" * 200_000, where=WHERE)
