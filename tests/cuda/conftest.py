"""The GPU tests: skipped, with the reason, where no CUDA device is visible.

They are collected by `make test` everywhere, so a machine without a GPU
shows each one as skipped instead of hiding it.  Results measured on a GPU
machine are written as JSON lines to ``$RINGMASTER_CUDA_RESULTS`` when set.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

NO_GPU = "no CUDA device is visible on this machine"
ONE_GPU = "needs 2 or more CUDA devices: NCCL refuses two ranks on one device"


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.cuda)
            if gpus() == 0:
                item.add_marker(pytest.mark.skip(reason=NO_GPU))


def record(name: str, **figures: object) -> None:
    """Print a measured figure and keep it for the note (JSON lines)."""
    line = json.dumps({"test": name, **figures})
    print(line)
    out = os.environ.get("RINGMASTER_CUDA_RESULTS")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")
