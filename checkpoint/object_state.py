"""Tracked objects' state in a checkpoint: their tensors as DCP entries, the rest pickled.

``TrainState.objects`` holds anything with ``state_dict()``/``load_state_dict()``:
a ``GradScaler``, more schedulers, a counter, and model-sized ones such as an
EMA copy of the weights.  Each object's state dict is taken apart when a save
starts: every plain tensor in it becomes a flat entry of its own,
``objects.<name>.<n>``, written and read by DCP like the model's tensors (no
pickling of tensor data, read straight into a buffer on restore), and what
is left, the *skeleton*, with a :class:`TensorSlot` where each tensor was,
travels in ``extra``'s pickled object.  A restore allocates the entries from
the checkpoint's metadata, loads them, and puts them back into the skeleton
before calling the object's ``load_state_dict``.

Checkpoints written before this kept whole state dicts in ``extra``: their
skeletons hold no slot and load as they are.  Sharded tensors (``DTensor``)
stay in the skeleton, as they always were.  Runs in the training process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint.api import CheckpointMismatchError
from checkpoint.flat_state import OBJECT_PREFIX, FlatState, is_object_key, is_sharded

__all__ = ["TensorSlot", "join_tensors", "match_object_targets", "split_tensors"]


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor of an object's state dict was: the flat key it is saved under.

    Pickled into checkpoints: keep its module and name.
    """

    key: str


def _is_plain_tensor(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor) and not is_sharded(value) and value.layout is torch.strided
    )


def _map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` rebuilt with ``leaf`` applied to everything that is not a mapping
    (its type and attributes kept: an ``OrderedDict``'s module versions), list or tuple."""
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _map_leaves(v, leaf)
        return out
    if type(value) in (list, tuple):
        return type(value)(_map_leaves(v, leaf) for v in value)
    return leaf(value)


def split_tensors(name: str, state: Any) -> tuple[Any, FlatState]:
    """``state`` with each plain tensor replaced by a :class:`TensorSlot`, and the tensors
    by flat key (``objects.<name>.<n>``).  Mappings (their type and attributes kept),
    lists and tuples are entered; the tensors are not copied."""
    tensors: FlatState = {}

    def slot(value: Any) -> Any:
        if not _is_plain_tensor(value):
            return value
        key = f"{OBJECT_PREFIX}{name}.{len(tensors)}"
        tensors[key] = value.detach()
        return TensorSlot(key)

    return _map_leaves(state, slot), tensors


def join_tensors(skeleton: Any, loaded: Mapping[str, Any], where: str) -> Any:
    """The state dict of :func:`split_tensors`'s ``skeleton`` with its tensors from ``loaded``.

    Raises:
        CheckpointMismatchError: a slot's entry is not in ``loaded``.
    """

    def fill(value: Any) -> Any:
        if not isinstance(value, TensorSlot):
            return value
        if value.key not in loaded:
            raise CheckpointMismatchError(
                f"{where} lacks the entry {value.key} that an object's state refers to; "
                "the checkpoint is incomplete"
            )
        return loaded[value.key]

    return _map_leaves(skeleton, fill)


def match_object_targets(target: FlatState, available: Mapping[str, Any]) -> None:
    """Make ``target``'s object entries those of a checkpoint's metadata (``available``):
    each one it holds, allocated with the saved shape and dtype, and no other."""
    for key in [k for k in target if is_object_key(k) and k not in available]:
        del target[key]
    for key, meta in available.items():
        if not is_object_key(key) or not isinstance(meta, TensorStorageMetadata):
            continue
        have = target.get(key)
        dtype = meta.properties.dtype
        if not isinstance(have, torch.Tensor) or have.shape != meta.size or have.dtype != dtype:
            target[key] = torch.empty(meta.size, dtype=dtype)
