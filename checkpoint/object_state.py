"""Tracked objects' state in a checkpoint: their tensors as DCP entries, the rest pickled.

``TrainState.objects`` holds anything with ``state_dict()``/``load_state_dict()``:
a ``GradScaler``, more schedulers, a counter, and model-sized ones such as an
EMA copy of the weights.  Each object's state dict is taken apart when a save
starts: every plain tensor in it becomes a flat entry of its own, written
and read by DCP like the model's tensors (no pickling of tensor data, read
straight into the state on restore), and what
is left, the *skeleton*, with a :class:`TensorSlot` where each tensor was,
travels in ``extra``'s pickled object.

An entry's key names where its tensor sits in the state dict,
``objects.<name>/<part>/<part>...`` (each part percent-quoted: a module's
``layers.0.weight`` stays as it is), so the same key means the same tensor in
the state dict saved and in the live object's.  A restore therefore loads
each entry straight into the live object's own tensor where the two agree in
shape and dtype (:func:`live_object_targets`): an EMA copy of the weights is
filled in place, with no new memory and no second copy, and its
``load_state_dict`` then copies each tensor onto itself (a no-op); a load that
fails after the checkpoint verified leaves them filled, as it leaves the
model's parameters.  A tensor a load cannot write (``meta``, an inference
tensor, an expanded one) is left alone.  Entries
the live object lacks, or holds in another shape, are allocated from the
checkpoint's metadata (:func:`match_object_targets`); the object's
``load_state_dict`` decides what to make of them.

Keys of checkpoints written before were numbered (``objects.<name>.<n>``), and
a state dict whose parts would give two tensors one key still is: such
entries never meet a live tensor, and load into new memory as before.
Checkpoints older still kept whole state dicts in ``extra``: their skeletons
hold no slot and load as they are.  Sharded tensors (``DTensor``) stay in the
skeleton, as they always were.  Runs in the training process.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint.api import CheckpointMismatchError
from checkpoint.flat_state import OBJECT_PREFIX, FlatState, is_object_key, is_sharded

__all__ = [
    "TensorSlot",
    "join_tensors",
    "live_object_targets",
    "match_object_targets",
    "split_tensors",
]

log = logging.getLogger(__name__)

#: Between an object's name and the parts of the path to a tensor in its state dict.
PATH_SEPARATOR = "/"


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


def _map_leaves(
    value: Any, leaf: Callable[[tuple[Any, ...], Any], Any], path: tuple[Any, ...] = ()
) -> Any:
    """``value`` rebuilt with ``leaf(path, v)`` applied to everything that is not a
    mapping (its type and attributes kept: an ``OrderedDict``'s module versions), list
    or tuple; ``path`` holds the keys and indices that lead to it."""
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _map_leaves(v, leaf, (*path, k))
        return out
    if type(value) in (list, tuple):
        return type(value)(_map_leaves(v, leaf, (*path, i)) for i, v in enumerate(value))
    return leaf(path, value)


def _path_key(name: str, path: tuple[Any, ...]) -> str:
    parts = PATH_SEPARATOR.join(quote(str(p), safe=".") for p in path)
    return f"{OBJECT_PREFIX}{quote(name, safe='.')}{PATH_SEPARATOR}{parts}"


def _split(name: str, state: Any) -> tuple[Any, FlatState, bool]:
    """:func:`split_tensors`, and whether the keys are paths (False: numbered)."""
    paths: list[tuple[Any, ...]] = []
    _map_leaves(state, lambda path, v: paths.append(path) if _is_plain_tensor(v) else None)
    keys = [_path_key(name, p) for p in paths]
    by_path = len(set(keys)) == len(keys)
    if not by_path:
        keys = [f"{OBJECT_PREFIX}{quote(name, safe='.')}.{n}" for n in range(len(paths))]
    key_of = dict(zip(paths, keys, strict=True))
    tensors: FlatState = {}

    def slot(path: tuple[Any, ...], value: Any) -> Any:
        if not _is_plain_tensor(value):
            return value
        key = key_of[path]
        tensors[key] = value.detach()
        return TensorSlot(key)

    return _map_leaves(state, slot), tensors, by_path


def split_tensors(name: str, state: Any) -> tuple[Any, FlatState]:
    """``state`` with each plain tensor replaced by a :class:`TensorSlot`, and the tensors
    by flat key: ``objects.<name>/<path>`` (see the module's docstring), numbered
    ``objects.<name>.<n>`` when two paths would give one key (a key ``0`` beside a
    key ``"0"``).  Mappings (their type and attributes kept), lists and tuples are
    entered; the tensors are not copied."""
    skeleton, tensors, _ = _split(name, state)
    return skeleton, tensors


def live_object_targets(objects: Mapping[str, Any]) -> FlatState:
    """The tracked objects' own tensors, by the keys their state dicts' entries are saved
    under, for a restore to load into (see the module's docstring).

    Only path keys are given: a numbered key says where a tensor came in the
    state dict's order, not what it is, so it never names a live tensor.
    """
    targets: FlatState = {}
    for name, obj in objects.items():
        try:
            _, tensors, by_path = _split(name, obj.state_dict())
        except Exception as e:  # its load_state_dict is what the restore needs: go on
            log.debug("object %r gives no state dict to restore into: %s", name, e)
            continue
        if by_path:
            targets.update({k: t for k, t in tensors.items() if _writable_in_place(t)})
    return targets


def _writable_in_place(t: torch.Tensor) -> bool:
    """A tensor a load can copy into: holding data (not ``meta``), not an inference
    tensor, each element its own memory (an expanded tensor's share it)."""
    return t.device.type != "meta" and not t.is_inference() and t.is_contiguous()


def join_tensors(skeleton: Any, loaded: Mapping[str, Any], where: str) -> Any:
    """The state dict of :func:`split_tensors`'s ``skeleton`` with its tensors from ``loaded``.

    Raises:
        CheckpointMismatchError: a slot's entry is not in ``loaded``.
    """

    def fill(_: tuple[Any, ...], value: Any) -> Any:
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
