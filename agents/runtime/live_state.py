"""A worker's live state as a state sync sends it (runs in the training process).

What the most advanced rank of a new generation captures and the ranks behind
it load (:func:`agents.recovery.state_sync.sync_state`): the step, every
tracked object's state dict and the RNG state.  :func:`replicated` says which
of its tensors every rank at one step holds alike, so that each such rank can
send a share of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from agents.api import Stateful

__all__ = ["capture", "replicated", "restore"]

#: Tracked objects a DDP keeps alike on every rank at one step: its model (every
#: gradient averaged) and the optimizer that steps it.
REPLICATED = ("model", "optimizer")


def replicated(path: tuple[Any, ...]) -> bool:
    """Whether the tensor at ``path`` of a :func:`capture` is the same on every rank at one
    step, for a job whose replicas are kept identical
    (:meth:`agents.runtime.wrapping.WrappedModels.replicas_identical`)."""
    return len(path) >= 2 and path[0] == "tracked" and path[1] in REPLICATED


def capture(step: int, tracked: Mapping[str, Stateful]) -> dict[str, Any]:
    """This rank's live state, to send to the ranks behind it."""
    return {
        "step": step,
        "tracked": {name: obj.state_dict() for name, obj in tracked.items()},
        "rng": torch.get_rng_state(),
    }


def restore(tracked: Mapping[str, Stateful], state: dict[str, Any]) -> None:
    """Load a live state sent by the most advanced rank into the tracked objects."""
    for name, obj in tracked.items():
        if name in state["tracked"]:
            obj.load_state_dict(state["tracked"][name])
    torch.set_rng_state(state["rng"])
