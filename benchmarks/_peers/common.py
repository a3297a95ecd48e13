"""What every system in benchmarks/peers.py trains: one job, written once.

The model, data order, global batch and per-step work of examples/train_tiny.py
(the data set and the batch of a step come from there).  Each worker appends
one line per completed step to ``<step_log>/<pid>.log``::

    step t_start t_end world pid

``t_start`` is taken before the step's first operation (so a step that ran when
a node was killed is told from one started after it) and ``t_end`` once the
step counts as done by the system (its update applied and, under torchft,
committed).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_tiny import GLOBAL_BATCH, batch, dataset
from train_tiny import make_model as tiny_model

__all__ = ["GLOBAL_BATCH", "StepLog", "batch", "dataset", "loss_of", "make_model", "make_opt"]

LR, MOMENTUM = 0.05, 0.9


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return tiny_model()


def make_opt(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)  # type: ignore[arg-type]


def loss_of(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, world: int) -> torch.Tensor:
    """Mean over the global batch when the gradients are averaged over ``world`` ranks."""
    return F.cross_entropy(model(xb), yb, reduction="sum") * world / GLOBAL_BATCH


class StepLog:
    """One worker's log of completed steps (see the module docstring)."""

    def __init__(self, directory: str | None) -> None:
        self._f: TextIO | None = None
        if directory:
            self._f = open(os.path.join(directory, f"{os.getpid()}.log"), "a")  # noqa: SIM115

    def done(self, step: int, t_start: float, world: int) -> None:
        if self._f is not None:
            self._f.write(f"{step} {t_start:.6f} {time.time():.6f} {world} {os.getpid()}\n")
            self._f.flush()
