"""Manifest encoding, checksums and the job spec hash.

The manifest is JSON with a ``self_checksum`` over its own canonical body, so a
manifest truncated by a crash, or edited by hand, never parses as a commit
(that self-checksum is CRC-32 in every format version).  Object checksums use
the algorithm the manifest names (:mod:`checkpoint.checksums`); they catch
torn writes and flipped bits, they are not a defence against tampering.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import zlib
from enum import Enum
from typing import Any

from checkpoint.api import (
    MANIFEST_FORMAT,
    CheckpointCorruptError,
    Manifest,
    ObjectEntry,
)
from checkpoint.checksums import KNOWN_ALGORITHMS

#: Read size when checksumming existing objects.
CHECKSUM_CHUNK_BYTES = 8 << 20


def crc32_hex(data: bytes) -> str:
    """CRC-32 of ``data`` as 8 lowercase hex digits."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def _body(manifest: Manifest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "format": manifest.format,
        "step": manifest.step,
        "world_size": manifest.world_size,
        "job_spec_hash": manifest.job_spec_hash,
        "created_at": manifest.created_at,
        "samples_seen": manifest.samples_seen,
        "checksum_algorithm": manifest.checksum_algorithm,
        "objects": [
            {"path": o.path, "size": o.size, "checksum": o.checksum} for o in manifest.objects
        ],
    }
    # Only when known: a manifest without a run id is byte for byte what it always was.
    if manifest.run_id:
        body["run_id"] = manifest.run_id
    return body


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_manifest(manifest: Manifest) -> bytes:
    """Serialise ``manifest`` to JSON bytes carrying their own checksum."""
    body = _body(manifest)
    out = dict(body, self_checksum=crc32_hex(_canonical(body)))
    return json.dumps(out, sort_keys=True, indent=1).encode()


def decode_manifest(data: bytes, where: str = "<manifest>") -> Manifest:
    """Parse manifest bytes, checking every field.

    Raises:
        CheckpointCorruptError: not JSON, incomplete, a newer format, the
            self-checksum does not match, or a field holds something no writer
            produces (a negative step, a non-integer size, an object path that
            leaves the checkpoint directory...).
    """
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointCorruptError(f"{where}: unreadable manifest (not JSON: {e})") from e
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(f"{where}: unreadable manifest (not a JSON object)")
    claimed = raw.pop("self_checksum", None)
    if claimed is None:
        raise CheckpointCorruptError(f"{where}: unreadable manifest (no self_checksum)")
    try:
        body = _canonical(raw)
    except (ValueError, TypeError, RecursionError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable manifest ({e})") from e
    if crc32_hex(body) != claimed:
        raise CheckpointCorruptError(f"{where}: manifest self-checksum does not match")
    fmt = _int(raw, "format", where, minimum=1)
    if fmt > MANIFEST_FORMAT:
        raise CheckpointCorruptError(
            f"{where}: manifest format {fmt} is newer than this reader "
            f"({MANIFEST_FORMAT}); upgrade ringmaster to read it"
        )
    algorithm = raw.get("checksum_algorithm")
    if not isinstance(algorithm, str) or algorithm not in KNOWN_ALGORITHMS:
        raise CheckpointCorruptError(
            f"{where}: objects are checksummed with {algorithm!r}, which this reader does "
            f"not know (known: {', '.join(KNOWN_ALGORITHMS)}); upgrade ringmaster to verify "
            "or load this checkpoint"
        )
    objects = raw.get("objects")
    if not isinstance(objects, list):
        raise CheckpointCorruptError(f"{where}: unreadable manifest (objects is not a list)")
    created_at = raw.get("created_at")
    if (
        not isinstance(created_at, int | float)
        or isinstance(created_at, bool)
        or not math.isfinite(created_at)
    ):
        raise CheckpointCorruptError(f"{where}: created_at {created_at!r} is not a time")
    spec_hash = raw.get("job_spec_hash")
    if not isinstance(spec_hash, str):
        raise CheckpointCorruptError(f"{where}: job_spec_hash {spec_hash!r} is not text")
    run_id = raw.get("run_id", "")  # absent from manifests written before runs were recorded
    if not isinstance(run_id, str):
        raise CheckpointCorruptError(f"{where}: run_id {run_id!r} is not text")
    return Manifest(
        step=_int(raw, "step", where, minimum=0),
        world_size=_int(raw, "world_size", where, minimum=1),
        job_spec_hash=spec_hash,
        created_at=float(created_at),
        objects=tuple(_object(o, f"{where}: objects[{i}]") for i, o in enumerate(objects)),
        samples_seen=_int(raw, "samples_seen", where, minimum=0),
        format=fmt,
        checksum_algorithm=algorithm,
        run_id=run_id,
    )


_CHECKSUM_RE = re.compile(r"^[0-9a-f]{8}\Z")


def _int(raw: dict[str, Any], name: str, where: str, minimum: int) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointCorruptError(
            f"{where}: {name} {value!r} is not an integer of at least {minimum}"
        )
    return value


def _object(entry: Any, where: str) -> ObjectEntry:
    if not isinstance(entry, dict):
        raise CheckpointCorruptError(f"{where} is not an object entry")
    path, checksum = entry.get("path"), entry.get("checksum")
    if not isinstance(path, str) or not safe_object_path(path):
        raise CheckpointCorruptError(
            f"{where}: path {path!r} is not a relative path inside the checkpoint directory"
        )
    if not isinstance(checksum, str) or not _CHECKSUM_RE.match(checksum):
        raise CheckpointCorruptError(f"{where}: checksum {checksum!r} is not 8 hex digits")
    return ObjectEntry(path=path, size=_int(entry, "size", where, minimum=0), checksum=checksum)


def safe_object_path(path: str) -> bool:
    """True for a relative ``a/b`` path that stays inside its directory.

    No absolute paths, no ``.`` or ``..`` or empty parts, no backslashes or
    control characters: a manifest cannot make a reader open another file.
    """
    if not path or path.startswith("/") or "\\" in path:
        return False
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def job_spec_hash(spec: Any) -> str:
    """A stable 16-hex-digit hash of a job spec (a dataclass tree or a plain dict)."""
    return hashlib.sha256(_canonical(_plain(spec))).hexdigest()[:16]
