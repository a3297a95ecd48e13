"""Object checksums: CRC-32C for new checkpoints, CRC-32 to verify older ones.

A checksum is computed once, while an object streams out to storage
(:class:`checkpoint.fsspec_storage.ChecksummingWriter`), and again only when
someone verifies the object.  The manifest names the algorithm
(``checksum_algorithm``), so checkpoints written before CRC-32C was adopted
still verify with plain CRC-32.

CRC-32C comes from ``google-crc32c`` (SSE4.2/ARMv8 instructions, over 10
GB/s on one core, the GIL released), read straight from the written buffer;
CRC-32 from ``zlib``.
Both catch torn writes and flipped bits; neither is a defence against
tampering.
"""

from __future__ import annotations

import ctypes
import logging
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import google_crc32c
import numpy as np

from checkpoint.api import CHECKSUM_ALGORITHM

log = logging.getLogger(__name__)

#: Algorithm of new manifests.
DEFAULT_ALGORITHM = CHECKSUM_ALGORITHM

#: google-crc32c's Python entry point only accepts ``bytes``; when its C library
#: cannot be called directly (see :func:`_direct_crc32c`), other buffers (a
#: tensor's memory) are fed in slices of this size, each copied once into a
#: small, cache-resident ``bytes``.
_SLICE_BYTES = 1 << 20


def _direct_crc32c() -> Callable[[int, Any], int] | None:
    """``crc32c_extend`` of the library bundled with google-crc32c, called without copies.

    The wheel ships ``libcrc32c`` beside the package; ctypes releases the
    GIL during the call.  None when the library is not where the wheel puts it.
    """
    libs = Path(google_crc32c.__file__).resolve().parent.parent / "google_crc32c.libs"
    for candidate in sorted(libs.glob("libcrc32c*.so*")):
        try:
            lib = ctypes.CDLL(str(candidate))
            fn = lib.crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]

        def extend(crc: int, view: Any, _fn: Any = fn) -> int:
            array = np.frombuffer(view, dtype=np.uint8)  # no copy, read-only is fine
            return int(_fn(crc, array.ctypes.data, array.nbytes))

        if extend(0, memoryview(b"123456789")) == 0xE3069283:  # the standard check value
            return extend
    log.debug("google-crc32c's library not found under %s; checksumming through copies", libs)
    return None


_extend_view = _direct_crc32c()


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
        if _extend_view is not None and view.nbytes:
            self.value = _extend_view(self.value, view)
            self.size += view.nbytes
            return
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
