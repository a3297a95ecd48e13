"""Object checksums: CRC-32C for new checkpoints, CRC-32 to verify older ones.

A checksum is computed once, while an object streams out to storage
(:class:`checkpoint.fsspec_storage.ChecksummingWriter`), and again only when
someone verifies the object.  The manifest names the algorithm
(``checksum_algorithm``), so checkpoints written before CRC-32C was adopted
still verify with plain CRC-32.

CRC-32C comes from ``google-crc32c`` (SSE4.2/ARMv8 instructions, over 10
GB/s on one core, the GIL released), read straight from the written buffer;
CRC-32 from ``zlib``.  A large buffer held whole (a restore's mapped or
fetched object) is checksummed in pieces on several cores at once, and the
pieces' CRCs combined into the whole's (:func:`checksum_buffer`).
Both catch torn writes and flipped bits; neither is a defence against
tampering.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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


#: Polynomial of CRC-32C, bit-reflected.
_CRC32C_POLY = 0x82F63B78

#: A buffer is cut into pieces for several threads only where each is at least this long.
PARALLEL_PIECE_BYTES = 32 << 20

#: Threads one buffer's checksum runs on at most.
MAX_CHECKSUM_THREADS = 8


def _gf2_apply(operator: list[int], vector: int) -> int:
    """``operator`` (32 columns, one per input bit) applied to a 32-bit ``vector`` over GF(2)."""
    out, bit = 0, 0
    while vector:
        if vector & 1:
            out ^= operator[bit]
        vector >>= 1
        bit += 1
    return out


@functools.cache
def _zero_run_operators() -> tuple[list[int], ...]:
    """Operators that advance a CRC-32C register over 2^k zero bytes, k = 0..63.

    One zero bit shifts the reflected register right and folds the polynomial in
    where a 1 fell out; squaring an operator doubles the run it stands for.
    """
    op = [_CRC32C_POLY] + [1 << (i - 1) for i in range(1, 32)]  # one zero bit
    for _ in range(3):  # 8 bits: one byte
        op = [_gf2_apply(op, column) for column in op]
    ops = [op]
    for _ in range(63):
        ops.append([_gf2_apply(ops[-1], column) for column in ops[-1]])
    return tuple(ops)


def crc32c_combine(first: int, second: int, second_length: int) -> int:
    """CRC-32C of ``a + b`` from the CRC-32C of ``a`` (``first``), that of ``b``
    (``second``) and ``len(b)``, without the bytes.

    The register after ``a`` is carried over ``len(b)`` zero bytes (the
    pre- and post-conditioning of both CRCs cancel out), then ``b``'s CRC is
    added in.
    """
    for k, op in enumerate(_zero_run_operators()):
        if not second_length >> k:
            break
        if second_length >> k & 1:
            first = _gf2_apply(op, first)
    return first ^ second


def checksum_threads() -> int:
    """Threads :func:`checksum_buffer` may use: the cores this process may run on (at most
    :data:`MAX_CHECKSUM_THREADS`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_CHECKSUM_THREADS))


def checksum_buffer(data: Any, algorithm: str, threads: int | None = None) -> tuple[int, str]:
    """(size, checksum hex) of a whole buffer (bytes, a mapping, a memoryview).

    CRC-32C of a buffer of at least two :data:`PARALLEL_PIECE_BYTES` pieces is
    computed on up to ``threads`` cores (None: :func:`checksum_threads`) at
    once, one piece each, the GIL released; the result is the same as one
    pass over it.  Anything else is one pass.

    Raises:
        ValueError: an algorithm this version does not know.
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    count = min(threads or checksum_threads(), view.nbytes // PARALLEL_PIECE_BYTES)
    if algorithm != "crc32c" or _extend_view is None or count < 2:
        crc = new_checksum(algorithm)
        crc.update(data)
        return crc.size, crc.hexdigest()
    extend = _extend_view
    bounds = [view.nbytes * i // count for i in range(count + 1)]
    pieces = [view[a:b] for a, b in itertools.pairwise(bounds)]
    try:
        with ThreadPoolExecutor(count, thread_name_prefix="checksum") as pool:
            crcs: list[int] = list(pool.map(lambda piece: extend(0, piece), pieces))
    finally:
        for piece in pieces:
            piece.release()  # a mapping cannot be closed while views of it are alive
    value = crcs[0]
    for piece_crc, (a, b) in zip(crcs[1:], itertools.pairwise(bounds[1:]), strict=True):
        value = crc32c_combine(value, piece_crc, b - a)
    size = view.nbytes
    view.release()
    return size, f"{value & 0xFFFFFFFF:08x}"


def checksum_hex(data: bytes, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Checksum of ``data`` as 8 lowercase hex digits."""
    c = new_checksum(algorithm)
    c.update(data)
    return c.hexdigest()
