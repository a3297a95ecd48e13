"""Give an optimizer that has not stepped the state a checkpoint holds for it, without a step.

To load a checkpoint into an optimizer, DCP needs the optimizer's state to
exist; for one that has not stepped, torch makes it by running a step with
zero gradients and learning rate 0: gradients the size of the model, then
every update pass of the optimizer over the parameters.  At a gigabyte of
Adam state that is about half a second of a resume, spent computing numbers
the load then overwrites.

:func:`shape_from_checkpoint` makes the same state from the checkpoint's own
metadata instead: for each parameter, each tensor the checkpoint holds for it
(``optim.state.<parameter>.<name>``), empty, of the saved size and dtype.  It
does so only when the checkpoint's parameter groups have this optimizer's
keys (the same kind of optimizer), it accounts for every parameter and every
saved entry belongs to one, and the model is not sharded (``DTensor``
parameters keep torch's way); otherwise it leaves the optimizer as it was
and torch's step runs as before.  Nothing it allocates is read before the
load has filled it: a restore that finds nothing to load, or fails, clears
the state.  Parameters come in torch's order; a parameter's entries in the
checkpoint's (which may differ from the order a step would give them: no
optimizer reads a state dict by its order).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from checkpoint.commit import latest_committed
from checkpoint.fsspec_storage import Location
from checkpoint.location_reader import LocationReader

__all__ = ["parameter_names", "shape_from_checkpoint", "shape_from_newest"]

log = logging.getLogger(__name__)

#: Flat-state prefix of per-parameter optimizer state (see :mod:`checkpoint.flat_state`).
STATE_PREFIX = "optim.state."
#: Flat-state prefix of the optimizer's parameter groups.
GROUPS_PREFIX = "optim.param_groups."
#: Module wrappers whose attribute name torch leaves out of a parameter's name in state dicts.
_WRAPPERS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def parameter_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Each parameter by the name state dicts give it (wrappers such as DDP's left out)."""
    return {
        ".".join(p for p in name.split(".") if p not in _WRAPPERS): param
        for name, param in model.named_parameters()
    }


def shape_from_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> bool:
    """Fill an unstepped ``optimizer``'s state with empty tensors shaped as in ``saved``.

    Args:
        saved: the checkpoint's DCP ``state_dict_metadata`` (flat keys).

    Returns:
        True when the state was made; False (nothing changed) when the
        optimizer already has state, the model is sharded, or the checkpoint
        does not account for its parameters exactly.
    """
    if optimizer.state:
        return False
    params = parameter_names(model)
    if any(isinstance(p, DTensor) for p in params.values()):
        return False
    if not _same_kind(optimizer, saved):
        return False
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    wanted = {name for name, p in params.items() if id(p) in optimized}
    shapes: dict[str, dict[str, TensorStorageMetadata]] = {}
    for key, meta in saved.items():
        if not key.startswith(STATE_PREFIX):
            continue
        owner, _, entry = key[len(STATE_PREFIX) :].rpartition(".")
        if owner not in wanted or not isinstance(meta, TensorStorageMetadata):
            log.debug("optimizer state not shaped from the checkpoint: %s", key)
            return False
        shapes.setdefault(owner, {})[entry] = meta
    if set(shapes) != wanted:  # a parameter the checkpoint holds no state for
        return False
    names = {id(p): name for name, p in params.items()}
    if any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
        return False  # a parameter the model does not hold: torch's way names it
    for param in (p for g in optimizer.param_groups for p in g["params"]):  # torch's order
        entries = shapes[names[id(param)]]
        optimizer.state[param] = {
            entry: torch.empty(
                meta.size,
                dtype=meta.properties.dtype,
                # a 0-dim entry is a step count: torch keeps those on the CPU
                device=param.device if len(meta.size) else "cpu",
            )
            for entry, meta in entries.items()
        }
    return True


def _same_kind(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> bool:
    """The checkpoint's parameter groups have the keys this optimizer's have: the same
    kind of optimizer (an SGD checkpoint's state would not fit Adam, and the load is
    left to say so)."""
    groups: dict[int, set[str]] = {}
    for key in saved:
        if key.startswith(GROUPS_PREFIX):
            index, _, name = key[len(GROUPS_PREFIX) :].partition(".")
            if index.isdigit():
                groups.setdefault(int(index), set()).add(name)
    live = {i: set(g) for i, g in enumerate(optimizer.param_groups)}
    return bool(live) and groups == live


def shape_from_newest(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: Location, url: str | None
) -> threading.Thread | None:
    """:func:`shape_from_checkpoint` from the checkpoint a restore under ``root`` will
    most likely load (``url``'s, else the newest committed).

    Returns:
        A thread that is still writing the new state's pages (join it before
        anything is loaded into the state), or None when nothing was shaped.

    A hint only: whatever fails here leaves the optimizer to torch's own step,
    and the restore reports any real problem with the checkpoint.
    """
    try:
        name = url.rstrip("/").rsplit("/", 1)[-1] if url else None
        if name is None:
            newest = latest_committed(root)
            name = newest.name if newest is not None else None
        if name is not None:
            saved = LocationReader(root.child(name)).read_metadata().state_dict_metadata
            if shape_from_checkpoint(model, optimizer, saved):
                return _touch_in_background(optimizer)
    except Exception as e:
        log.debug("optimizer state not shaped from the checkpoint: %s", e)
    return None


def _touch_in_background(optimizer: torch.optim.Optimizer) -> threading.Thread:
    """Write every page of the new host state once, in a thread, while the restore verifies.

    Memory a process has never written costs a page fault per page on first
    write: at a gigabyte of Adam state about a tenth of a second, which the
    load would otherwise pay while it copies.  Torch releases the interpreter
    lock while it fills, so this overlaps the checksums.
    """
    tensors = [
        t
        for s in optimizer.state.values()
        for t in s.values()
        if t.numel() > 1 and t.device.type == "cpu"  # device memory is not paged in
    ]

    def touch() -> None:
        with torch.no_grad():
            for t in tensors:
                t.zero_()

    thread = threading.Thread(target=touch, name="optimizer-state-touch", daemon=True)
    thread.start()
    return thread
