"""A read-only, seekable stream over bytes already in memory, with no copy of them.

``io.BytesIO`` shares a ``bytes`` object but copies any other buffer whole
(a mapped file, a ``bytearray``); this stream reads from the buffer itself,
copying out only what each read asks for.
"""

from __future__ import annotations

import io
import os
from typing import Any

__all__ = ["BufferStream"]


class BufferStream(io.RawIOBase):
    """Reads ``buffer`` (anything with the buffer protocol) from position 0."""

    def __init__(self, buffer: Any) -> None:
        super().__init__()
        self._view = memoryview(buffer).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def readall(self) -> bytes:
        data = bytes(self._view[self._pos :])  # one copy, not a loop of small reads
        self._pos = len(self._view)
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._view.release()
        super().close()
