"""The optimizers and other objects a script tracked beside a sharded model.

Runs in the training process.  A sharded model's parameters are new objects
in every generation (:class:`~agents.state.sharding.ShardedModel` builds
them on the generation's mesh): :func:`repoint_optimizer` points the script's
optimizers at them and puts their state back; :func:`optimizers_of` and
:func:`others_of` tell the tracked optimizers from the rest (replicated state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["optimizers_of", "others_of", "repoint_optimizer"]


def repoint_optimizer(
    opt: torch.optim.Optimizer,
    old: dict[str, nn.Parameter],
    new: dict[str, nn.Parameter],
    state: dict[str, dict[str, Any]],
) -> None:
    """Point ``opt``'s parameter groups from ``old`` parameters to ``new`` ones
    (matched by name) and replace its state with ``state`` (by name).  A parameter
    ``new`` lacks is dropped: a pipeline stage holds only its own (the optimizer was
    built on the whole model's before the first generation).

    Raises:
        ValueError: ``opt`` holds a parameter that is not one of ``old``'s.
    """
    name_of = {id(p): n for n, p in old.items()}
    for group in opt.param_groups:
        names = []
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError(
                    "an optimizer tracked beside a sharded model holds a parameter that is not "
                    "the model's; build it on model.parameters() after session.wrap()"
                )
            names.append(name_of[id(p)])
        group["params"] = [new[n] for n in names if n in new]
    opt.state.clear()
    for n, st in state.items():
        if st:
            opt.state[new[n]] = st


def optimizers_of(tracked: Mapping[str, Any]) -> dict[str, torch.optim.Optimizer]:
    """The tracked optimizers, by their tracked name."""
    return {n: o for n, o in tracked.items() if isinstance(o, torch.optim.Optimizer)}


def others_of(tracked: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """Tracked objects other than the model and the optimizers (replicated state); an
    object whose ``rank_local`` is true (each rank's own: a sharded model's outer
    state under a delayed sync) is left out."""
    return {
        n: o
        for n, o in tracked.items()
        if o is not model
        and not isinstance(o, torch.optim.Optimizer)
        and not getattr(o, "rank_local", False)
    }
