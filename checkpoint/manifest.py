"""Manifest encoding, checksums and the job spec hash.

The manifest is JSON with a ``self_checksum`` over its own canonical body, so a
manifest truncated by a crash, or edited by hand, never parses as a commit
(that self-checksum is CRC-32 in every format version).  Object checksums use
the algorithm the manifest names (:mod:`checkpoint.checksums`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
    return {
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


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_manifest(manifest: Manifest) -> bytes:
    """Serialise ``manifest`` to JSON bytes carrying their own checksum."""
    body = _body(manifest)
    out = dict(body, self_checksum=crc32_hex(_canonical(body)))
    return json.dumps(out, sort_keys=True, indent=1).encode()


def decode_manifest(data: bytes, where: str = "<manifest>") -> Manifest:
    """Parse manifest bytes.

    Raises:
        CheckpointCorruptError: not JSON, incomplete, a newer format, or the
            self-checksum does not match.
    """
    try:
        raw = json.loads(data)
        claimed = raw.pop("self_checksum")
        if crc32_hex(_canonical(raw)) != claimed:
            raise CheckpointCorruptError(f"{where}: manifest self-checksum does not match")
        if int(raw["format"]) > MANIFEST_FORMAT:
            raise CheckpointCorruptError(
                f"{where}: manifest format {raw['format']} is newer than this reader "
                f"({MANIFEST_FORMAT}); upgrade ringmaster to read it"
            )
        if raw["checksum_algorithm"] not in KNOWN_ALGORITHMS:
            raise CheckpointCorruptError(
                f"{where}: objects are checksummed with {raw['checksum_algorithm']!r}, "
                f"which this reader does not know (known: {', '.join(KNOWN_ALGORITHMS)}); "
                "upgrade ringmaster to verify or load this checkpoint"
            )
        objects = tuple(
            ObjectEntry(path=str(o["path"]), size=int(o["size"]), checksum=str(o["checksum"]))
            for o in raw["objects"]
        )
        return Manifest(
            step=int(raw["step"]),
            world_size=int(raw["world_size"]),
            job_spec_hash=str(raw["job_spec_hash"]),
            created_at=float(raw["created_at"]),
            objects=objects,
            samples_seen=int(raw["samples_seen"]),
            format=int(raw["format"]),
            checksum_algorithm=str(raw["checksum_algorithm"]),
        )
    except CheckpointCorruptError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable manifest ({e})") from e


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
