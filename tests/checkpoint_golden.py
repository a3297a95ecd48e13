"""Checkpoints kept in the repository, and the training state they hold.

``tests/data/checkpoints/`` holds checkpoints written by ringmaster with
torch 2.13.0 when the checkpoint package still used torch's private DCP
entry points (``_save_state_dict``, ``_nested_dict``, ``_fsspec_filesystem``):
one saved by a single process, one by two gloo ranks.  Every later version
must restore them.  :func:`build_state` makes the state they hold again, from
fixed numbers; what it computes for the model and the optimizer depends on the
CPU's kernels and thread count, though (two Adam steps turn gradients at the
noise level into steps of plus or minus the learning rate), so the numbers the
goldens hold are kept once more, with plain ``torch.save``, in
``expected-state.pt`` (:func:`expected_state`), and tests compare a restore
with those.  They were read back when that file was written and differ from
:func:`build_state` on that machine by at most 0.0055, within the two Adam
steps' reach (0.01 + 0.005).
To write them again (only when the on-disk format changes on purpose, and
then old ones must still be readable by other means)::

    python -m tests.checkpoint_golden tests/data/checkpoints
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint import Checkpointer, TrainState

GOLDEN_ROOT = Path(__file__).parent / "data" / "checkpoints"
#: Step and data position recorded in every golden checkpoint.
STEP = 2
SAMPLES_SEEN = 48


class Counter:
    """A replicated object saved through ``TrainState.objects``."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])


def fresh_state() -> TrainState:
    """A state of the same shape with other values, to restore into."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return TrainState(model, optimizer, scheduler, objects={"counter": Counter()})


def build_state(rank: int = 0) -> TrainState:
    """The state of the golden checkpoints: two Adam steps from fixed values.

    Every part a checkpoint carries is there: parameters and buffers (one an
    integer tensor), optimizer state (tensors per parameter, parameter groups
    as a list of dicts with a tuple inside), a scheduler, ``extra``,
    ``objects`` and a per-rank ``rank_state`` that differs by ``rank``.
    """
    state = fresh_state()
    with torch.no_grad():
        for i, p in enumerate(state.model.parameters()):
            p.copy_(torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape) * (i + 1))
    x = torch.linspace(-2.0, 2.0, 15).reshape(5, 3)
    y = torch.tensor([0, 1, 0, 1, 1])
    assert state.optimizer is not None and state.scheduler is not None
    for _ in range(STEP):
        state.optimizer.zero_grad()
        nn.functional.cross_entropy(state.model(x), y).backward()
        state.optimizer.step()
        state.scheduler.step()
    state.samples_seen = SAMPLES_SEEN
    state.extra.update({"epoch": 3, "note": "golden"})
    state.objects["counter"].value = 5
    state.rank_state.update({"residual": torch.full((3,), float(rank + 1)), "count": rank + 10})
    return state


def expected_state() -> dict[str, Any]:
    """The model, optimizer and scheduler state dicts every golden checkpoint holds."""
    state: dict[str, Any] = torch.load(GOLDEN_ROOT / "expected-state.pt")
    return state


def _write(rank: int, world_size: int, root: str) -> str:
    ckpt = Checkpointer(f"file://{root}", keep=1)
    manifest = ckpt.save_now(STEP, build_state(rank))
    ckpt.close()
    return str(manifest.step)


def write_golden(target: Path) -> None:
    """Write the single-process and the two-rank checkpoint under ``target``."""
    from tests.gloo import run_gloo

    for name in ("single", "two-ranks"):
        shutil.rmtree(target / name, ignore_errors=True)
        (target / name).mkdir(parents=True)
    _write(0, 1, str((target / "single").resolve()))
    run_gloo(_write, 2, str((target / "two-ranks").resolve()))


if __name__ == "__main__":
    write_golden(Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN_ROOT)
