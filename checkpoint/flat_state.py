"""Turn a :class:`~checkpoint.api.TrainState` into a flat dict and back.

The flat form maps dotted keys to tensors or small picklable objects:

* ``model.*`` — the model's state dict without DDP's ``module.`` prefix,
* ``optim.*`` — the optimizer keyed by parameter name (so it reshards),
* ``sched``, ``extra`` (opaque blobs) and ``data.samples_seen`` — replicated,
* ``rank.<r>`` — an opaque blob of rank ``r``: its RNG states and ``rank_state``,
* ``objects.<name>/<path>`` — the tensors of ``TrainState.objects``' state dicts
  (:mod:`checkpoint.object_state`), replicated.

Replicated keys are identical on every data-parallel rank, so each is written
by one owner rank (:func:`assign_owners` balances bytes across ranks without
communication); ``rank.<r>`` is written by rank ``r`` only.  Sharded keys
(``DTensor`` values of an FSDP2 model and its optimizer) are written by every
rank (every writer, when the replicated parts have writers), each its own
slice: DCP records where each slice sits in the whole tensor (and writes a
slice that replicas of an HSDP mesh share once), so a restore reshards to
any world size, and into a model that is not sharded.

Nested state dicts are flattened by :func:`flatten`, whose key scheme is the
one DCP's own flattening used when checkpoints were first written here (it is
private to torch, so it is done here): mappings are always entered, a list
only when it holds a tensor or a container that is entered, and the path is
joined with dots (``optim.param_groups.0.lr``).  Everything else, tuples
included, is one entry.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from checkpoint.api import CheckpointMismatchError, TrainState

RANK_PREFIX = "rank."
#: Prefix of the flat keys of tracked objects' tensors (see :mod:`checkpoint.object_state`).
OBJECT_PREFIX = "objects."
#: Owner of a sharded key: every rank writes its own slice.
EVERY_RANK = -1
#: Owner of a sharded key when the replicated parts have writers: each writer writes its
#: own slice (the writers hold every slice between them: an FSDP2 model in each site
#: under a delayed sync, whose first site writes, as it does the replicated parts).
WRITERS = -2
SAMPLES_KEY = "data.samples_seen"
EXTRA_KEY = "extra"
SCHED_KEY = "sched"
_OWN_KEYS = (SAMPLES_KEY, EXTRA_KEY, SCHED_KEY)

#: Size charged to a non-tensor value when balancing owners.
_OBJECT_COST = 1024

FlatState = dict[str, Any]
#: Path of each flat key in the nested dict: dict keys (str) and list indexes (int).
KeyPaths = dict[str, tuple[str | int, ...]]


def rank_key(rank: int) -> str:
    """Flat key of rank ``rank``'s own state."""
    return f"{RANK_PREFIX}{rank}"


def is_rank_key(key: str) -> bool:
    return key.startswith(RANK_PREFIX)


def is_object_key(key: str) -> bool:
    """A tensor of a tracked object's state (loaded by the object, not the model)."""
    return key.startswith(OBJECT_PREFIX)


def _enters(value: Any) -> bool:
    """Whether :func:`flatten` goes inside ``value`` rather than keeping it whole."""
    if isinstance(value, Mapping):
        return True
    if isinstance(value, list):
        return any(isinstance(v, torch.Tensor) or _enters(v) for v in value)
    return False


def flatten(nested: Mapping[str, Any]) -> tuple[FlatState, KeyPaths]:
    """A nested state dict as dotted keys, and each key's path for :func:`unflatten`.

    Raises:
        CheckpointMismatchError: two paths join to the same dotted key
            (``{"a.b": 1, "a": {"b": 2}}``).
    """
    flat: FlatState = {}
    paths: KeyPaths = {}

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit((*path, str(key)), item)
        elif _enters(value):
            for index, item in enumerate(value):
                visit((*path, index), item)
        else:
            key = ".".join(str(p) for p in path)
            if key in flat:
                raise CheckpointMismatchError(
                    f"two entries of the state flatten to the key {key!r}: "
                    f"{paths[key]} and {path}; rename one of them"
                )
            flat[key] = value
            paths[key] = path

    for key, value in nested.items():
        visit((str(key),), value)
    return flat, paths


def unflatten(flat: Mapping[str, Any], paths: KeyPaths) -> dict[str, Any]:
    """The nested dict that :func:`flatten` took apart (lists come back as lists)."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        path = paths[key]
        parent: Any = nested
        for part, child in itertools.pairwise(path):
            parent = _slot(parent, part, [] if isinstance(child, int) else {})
        _put(parent, path[-1], value)
    return nested


def _slot(container: Any, part: str | int, empty: dict[str, Any] | list[Any]) -> Any:
    """The container at ``part`` of ``container``, made ``empty`` when there is none."""
    if isinstance(container, list):
        assert isinstance(part, int)
        while len(container) <= part:
            container.append(None)
        if container[part] is None:
            container[part] = empty
        return container[part]
    return container.setdefault(part, empty)


def _put(container: Any, part: str | int, value: Any) -> None:
    if isinstance(container, list):
        assert isinstance(part, int)
        while len(container) <= part:
            container.append(None)
    container[part] = value


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _to_bytes(value: Any) -> bytes:
    # Opaque bytes survive DCP as they are (an empty dict value would vanish).
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(blob: Any) -> Any:
    return torch.load(io.BytesIO(bytes(blob)), weights_only=False)


def encode_rank_blob(state: TrainState) -> bytes:
    """This rank's RNG states and ``rank_state`` as one serialized blob."""
    return _to_bytes({"rng": _rng_states(), "state": state.rank_state})


def apply_rank_blob(state: TrainState, blob: bytes) -> None:
    """Restore RNG states and replace ``state.rank_state`` from a blob."""
    payload = _from_bytes(blob)
    _set_rng_states(payload["rng"])
    state.rank_state.clear()
    state.rank_state.update(payload["state"])


def capture(state: TrainState, rank: int) -> tuple[FlatState, KeyPaths]:
    """The flat state of ``state`` as seen by ``rank`` (tensors are not copied).

    Returns:
        The flat dict and the mapping that :func:`apply` needs to unflatten it.
    """
    nested: dict[str, Any] = {"model": get_model_state_dict(state.model)}
    if state.optimizer is not None:
        nested["optim"] = get_optimizer_state_dict(state.model, state.optimizer)
    flat, paths = flatten(nested)
    if state.scheduler is not None:
        flat[SCHED_KEY] = _to_bytes(state.scheduler.state_dict())
    flat[SAMPLES_KEY] = int(state.samples_seen)
    flat[EXTRA_KEY] = _to_bytes(dict(state.extra))
    flat[rank_key(rank)] = encode_rank_blob(state)
    return flat, paths


def apply(state: TrainState, flat: FlatState, mapping: KeyPaths, rank: int) -> bool:
    """Load a flat state (as filled by a restore) into ``state``.

    Returns:
        True when this rank's own blob (RNG, ``rank_state``) was present and applied.
    """
    replicated = {
        k: v
        for k, v in flat.items()
        if not is_rank_key(k) and not is_object_key(k) and k not in _OWN_KEYS
    }
    nested = unflatten(replicated, mapping)
    set_model_state_dict(state.model, nested["model"])
    if state.optimizer is not None:
        optim = nested["optim"]
        # An optimizer without per-parameter state (plain SGD) flattens to no
        # ``state`` entries at all; torch needs the empty dict back.
        optim.setdefault("state", {})
        set_optimizer_state_dict(state.model, state.optimizer, optim)
    if state.scheduler is not None and SCHED_KEY in flat:
        state.scheduler.load_state_dict(_from_bytes(flat[SCHED_KEY]))
    state.extra.clear()
    state.extra.update(_from_bytes(flat[EXTRA_KEY]))
    state.samples_seen = int(flat[SAMPLES_KEY])
    blob = flat.get(rank_key(rank))
    if isinstance(blob, bytes | bytearray):
        apply_rank_blob(state, bytes(blob))
        return True
    return False


def is_sharded(value: Any) -> bool:
    """True for a ``DTensor``: every rank holds (and writes) its own slice of it."""
    return isinstance(value, DTensor)


def owned_keys(
    owners: Mapping[str, int], rank: int, writers: tuple[int, ...] | None = None
) -> list[str]:
    """Keys ``rank`` writes: those it owns and every sharded key (only its writers'
    when the replicated parts have writers)."""
    mine = (rank, EVERY_RANK, WRITERS) if writers is None or rank in writers else (rank,)
    return [k for k, r in owners.items() if r in mine]


def nbytes(value: Any) -> int:
    """Bytes a value occupies when written (tensors exactly, objects a flat charge)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return _OBJECT_COST


def replicated_sizes(flat: Mapping[str, Any]) -> dict[str, int]:
    """Bytes of each replicated key (neither a rank's own nor sharded)."""
    return {k: nbytes(v) for k, v in flat.items() if not is_rank_key(k) and not is_sharded(v)}


def assign_owners(
    flat: Mapping[str, Any],
    world_size: int,
    writers: tuple[int, ...] | None = None,
    holders: Mapping[str, Sequence[int]] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Which rank writes each key: replicated keys balanced by bytes (over ``writers``,
    default every rank), rank keys to their rank, sharded keys to :data:`EVERY_RANK`
    (:data:`WRITERS` when ``writers`` are given).

    Deterministic from keys and sizes alone, so every rank computes the same
    answer without talking to the others (the layout digest is compared first).

    Args:
        holders: where ranks hold different keys (pipeline stages): each
            replicated key of every rank → the ranks that hold it, and ``sizes``
            its bytes; a key goes to one of its holders.
    """
    owners: dict[str, int] = {}
    loads = [0] * world_size
    candidates = [r for r in (writers or range(world_size)) if 0 <= r < world_size]
    candidates = candidates or list(range(world_size))
    size_of = dict(sizes) if sizes is not None else replicated_sizes(flat)
    replicated = sorted(size_of, key=lambda k: (-size_of[k], k))
    for key in replicated:
        pool = candidates
        if holders is not None:
            pool = [r for r in candidates if r in holders[key]] or sorted(holders[key])
        target = min(pool, key=lambda r: (loads[r], r))
        owners[key] = target
        loads[target] += size_of[key]
    for key in flat:
        if is_rank_key(key):
            owners[key] = int(key[len(RANK_PREFIX) :])
        elif is_sharded(flat[key]):
            owners[key] = EVERY_RANK if writers is None else WRITERS
    return owners


def layout_digest(flat: Mapping[str, Any]) -> str:
    """Hash of the replicated layout (keys, dtypes, shapes); equal on all DP ranks."""
    h = hashlib.sha256()
    for key in sorted(k for k in flat if not is_rank_key(k)):
        value = flat[key]
        if isinstance(value, torch.Tensor):
            h.update(f"{key}|{value.dtype}|{tuple(value.shape)}\n".encode())
        else:
            h.update(f"{key}|object\n".encode())
    return h.hexdigest()[:16]


def check_fits(target: Mapping[str, Any], available: Mapping[str, Any], where: str) -> None:
    """Raise when replicated keys of ``target`` are missing from ``available``, or
    when a tensor has another shape there (a different model: never load it)."""
    missing = sorted(k for k in target if not is_rank_key(k) and k not in available)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointMismatchError(
            f"{where} lacks {len(missing)} entries the model/optimizer expect ({shown}); "
            "was it saved from a different model or optimizer?"
        )
    reshaped = [
        f"{k} {tuple(available[k].size)} in the checkpoint, {tuple(v.shape)} here"
        for k, v in target.items()
        if isinstance(v, torch.Tensor)
        and hasattr(available.get(k), "size")
        and tuple(available[k].size) != tuple(v.shape)
    ]
    if reshaped:
        raise CheckpointMismatchError(
            f"{where} holds tensors of other shapes than the model/optimizer: "
            f"{'; '.join(sorted(reshaped)[:3])}; was it saved from a different model?"
        )
