"""DDP replicas: every rank holds the whole model; a join brings each to the freshest state.

Runs in the training process.  The recovery of the ``replicas`` kind of state
(:class:`ReplicaRecovery`): the most advanced rank of a new generation sends
its live state to the ranks behind it or new
(:func:`agents.recovery.state_sync.sync_state`); where no rank holds state (a
fresh or resumed job), the newest durable checkpoint is resumed.

A live state is what :func:`capture` takes and :func:`restore` loads: the
step, every tracked object's state dict and the RNG state.  :func:`replicated`
says which of its tensors every rank at one step holds alike, so that each
such rank can send a share of them.  :func:`live` gathers the three for a
join (the sites' recovery, :mod:`agents.recovery.site_join`, moves the same
live state within each site).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from agents.api import Stateful
from agents.recovery.state_sync import NO_STATE, sync_state
from agents.state.api import Holdings, Joining, Restored

__all__ = [
    "Live",
    "ReplicaRecovery",
    "capture",
    "live",
    "live_or_durable",
    "replicated",
    "restore",
]


class ReplicaRecovery:
    """The ``replicas`` kind: the most advanced rank's state to every rank behind it."""

    def join(self, joining: Joining, holdings: Holdings) -> Restored:
        state = live(joining, holdings)
        synced = sync_state(
            state.step, state.capture, state.restore, joining.control, shared=state.shared
        ).step
        return live_or_durable(joining, synced)


@dataclass(frozen=True)
class Live:
    """This rank's live state as a state sync moves it."""

    #: the step it holds (``NO_STATE``: none)
    step: int
    #: takes it (called on a rank that sends)
    capture: Callable[[], dict[str, Any]]
    #: loads a state another rank sent
    restore: Callable[[dict[str, Any]], None]
    #: which of its tensors every rank at one step holds alike (None: each its own)
    shared: Callable[[tuple[Any, ...]], bool] | None


def live(joining: Joining, holdings: Holdings) -> Live:
    """The live state of the worker joining, as a state sync moves it."""
    held = joining.held
    one = holdings.replica()
    return Live(
        step=held.step if joining.holds_state else NO_STATE,
        capture=functools.partial(capture, held.step, held.tracked),
        restore=functools.partial(restore, held.tracked),
        shared=replicated(held.tracked, one) if one is not None else None,
    )


def live_or_durable(joining: Joining, synced: int) -> Restored:
    """The step a state sync brought every rank to; where no rank held state
    (``synced`` is ``NO_STATE``), the newest durable checkpoint's, if one exists."""
    if synced != NO_STATE:
        return Restored(synced, True)
    durable = joining.durable
    resumed = durable.resume(joining.world_size) if durable.can_resume() else None
    if resumed is not None:
        return Restored(resumed.step, True, resumed.url)
    return Restored(joining.held.step, joining.holds_state)


def replicated(
    tracked: Mapping[str, Stateful], module: torch.nn.Module
) -> Callable[[tuple[Any, ...]], bool] | None:
    """Which tensors of a :func:`capture` every rank at one step holds alike, for a job
    whose one DDP model (``module``, tracked as ``model``) averages every gradient
    (:meth:`agents.state.api.Holdings.replica`): its parameters
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
