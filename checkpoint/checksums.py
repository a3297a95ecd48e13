"""Object checksums: CRC-32C for new checkpoints, CRC-32 to verify older ones.

A checksum is computed once, while an object streams out to storage
(:class:`checkpoint.fsspec_storage.ChecksummingWriter`), and again only when
someone verifies the object.  The manifest names the algorithm
(``checksum_algorithm``), so checkpoints written before CRC-32C was adopted
still verify with plain CRC-32.

CRC-32C comes from ``google-crc32c`` (SSE4.2/ARMv8 instructions, over 10
GB/s on one core, the GIL released on large inputs); CRC-32 from ``zlib``.
Both catch torn writes and flipped bits; neither is a defence against
tampering.
"""

from __future__ import annotations

import zlib
from typing import Any, Protocol

import google_crc32c

from checkpoint.api import CHECKSUM_ALGORITHM

#: Algorithm of new manifests.
DEFAULT_ALGORITHM = CHECKSUM_ALGORITHM

#: google-crc32c only accepts read-only buffers (``bytes``), so a writable view
#: (a tensor's memory) is fed in slices of this size, each copied once into a
#: small, cache-resident ``bytes``: far cheaper than the checksum it replaces.
_SLICE_BYTES = 1 << 20


class RunningChecksum(Protocol):
    """A checksum updated chunk by chunk, with a byte count."""

    algorithm: str
    size: int

    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


class Crc32:
    """CRC-32 (``zlib``), the algorithm of manifests before CRC-32C."""

    algorithm = "crc32"

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.value = zlib.crc32(view, self.value)
        self.size += view.nbytes

    def hexdigest(self) -> str:
        return f"{self.value & 0xFFFFFFFF:08x}"


class Crc32c:
    """CRC-32C (Castagnoli), hardware-accelerated through ``google-crc32c``."""

    algorithm = "crc32c"

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data: Any) -> None:
        if isinstance(data, bytes):
            self.value = google_crc32c.extend(self.value, data)
            self.size += len(data)
            return
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _SLICE_BYTES):
            self.value = google_crc32c.extend(self.value, bytes(view[start : start + _SLICE_BYTES]))
        self.size += view.nbytes

    def hexdigest(self) -> str:
        return f"{self.value & 0xFFFFFFFF:08x}"


_ALGORITHMS: dict[str, type[Crc32] | type[Crc32c]] = {"crc32": Crc32, "crc32c": Crc32c}

#: Algorithms this reader can verify.
KNOWN_ALGORITHMS = tuple(sorted(_ALGORITHMS))


def new_checksum(algorithm: str = DEFAULT_ALGORITHM) -> RunningChecksum:
    """A running checksum of ``algorithm``.

    Raises:
        ValueError: an algorithm this version does not know.
    """
    try:
        return _ALGORITHMS[algorithm]()
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r} (known: {', '.join(KNOWN_ALGORITHMS)})"
        ) from None


def checksum_hex(data: bytes, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Checksum of ``data`` as 8 lowercase hex digits."""
    c = new_checksum(algorithm)
    c.update(data)
    return c.hexdigest()
