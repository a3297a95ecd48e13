"""A worker's live state as a state sync sends it (runs in the training process).

What the most advanced rank of a new generation captures and the ranks behind
it load (:func:`agents.recovery.state_sync.sync_state`): the step, every
tracked object's state dict and the RNG state.  :func:`replicated` says which
of its tensors every rank at one step holds alike, so that each such rank can
send a share of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from agents.api import Stateful

__all__ = ["capture", "replicated", "restore"]


def replicated(
    tracked: Mapping[str, Stateful], module: torch.nn.Module
) -> Callable[[tuple[Any, ...]], bool] | None:
    """Which tensors of a :func:`capture` every rank at one step holds alike, for a job
    whose one DDP model (``module``, tracked as ``model``) averages every gradient
    (:meth:`agents.runtime.wrapping.WrappedModels.replicas_identical`): its parameters
    (not its buffers: a BatchNorm's running statistics come from each rank's own
    batches), and the state of the tracked ``optimizer`` where every parameter it steps
    is one of them.  None where the model tracked is not that DDP's.
    """
    model = tracked.get("model")
    if model is None or getattr(model, "module", None) is not module:
        return None
    params = {name for name, _ in module.named_parameters()}
    own = {id(p) for p in module.parameters()}
    optimizer = tracked.get("optimizer")
    groups = getattr(optimizer, "param_groups", None)
    stepped_alike = groups is not None and all(id(p) in own for g in groups for p in g["params"])

    def alike(path: tuple[Any, ...]) -> bool:
        if len(path) < 3 or path[0] != "tracked":
            return False
        if path[1] == "model":
            return path[2] in params
        return path[1] == "optimizer" and stepped_alike

    return alike


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
