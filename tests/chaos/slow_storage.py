"""A local filesystem whose writes are slow: checkpoints stay "uploading" long
enough for a fault to land in the middle of one.

:func:`register` makes it fsspec's ``file://`` implementation in the calling
process (a worker), so a job's ``file://`` checkpoints take at least
``RINGMASTER_TEST_SLOW_WRITE_S`` seconds per object written.
"""

from __future__ import annotations

import os
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


class SlowLocalFileSystem(LocalFileSystem):  # type: ignore[misc]
    @property
    def delay(self) -> float:
        return float(os.environ.get("RINGMASTER_TEST_SLOW_WRITE_S", "0.5"))

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax"):
            time.sleep(self.delay)
        return super()._open(path, mode, *args, **kwargs)

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay)
        return super().pipe_file(path, value, *args, **kwargs)


def register() -> None:
    for protocol in ("file", "local"):
        fsspec.register_implementation(protocol, SlowLocalFileSystem, clobber=True)
