"""examples/train_tiny.py on a disk that is full for checkpoints: every save's write
raises ``OSError(ENOSPC)``, as a full tmpfs would, where mounting one is not allowed.

Run as a job's entrypoint (it takes train_tiny's arguments): it makes its
filesystem fsspec's ``file://`` in the worker, then runs the example.  Only
objects inside a checkpoint directory (``step-*``) fail: the storage probe of
an empty root still succeeds, as it does on a small disk.
"""

from __future__ import annotations

import errno
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class FullLocalFileSystem(LocalFileSystem):  # type: ignore[misc]
    @staticmethod
    def _full(path: str) -> bool:
        return any(part.startswith("step-") for part in str(path).split("/"))

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax") and self._full(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super()._open(path, mode, *args, **kwargs)

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        if self._full(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super().pipe_file(path, value, *args, **kwargs)


if __name__ == "__main__":
    for protocol in ("file", "local"):
        fsspec.register_implementation(protocol, FullLocalFileSystem, clobber=True)
    example = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"
    sys.argv[0] = str(example)
    runpy.run_path(str(example), run_name="__main__")
