"""Bring every rank of a new generation to the most advanced live state.

After a failure the survivors may disagree by at most one step: a collective
can complete on some ranks (every contribution arrived, so their update is
correct) and fail on others.  A replacement has no state at all.  The rule is
simple: the rank with the highest step (lowest rank among equals) broadcasts
its state; everybody behind it loads it.  Each step is therefore applied
exactly once, and no completed step is lost.

The state travels in two parts: its structure (names, small values, each
tensor's shape and dtype) is pickled on the gloo control group, and the
tensors' bytes follow in fixed-size chunks (:mod:`~agents.recovery.tensor_stream`):
straight from the sender's tensors, with no copy of the whole state, point to
point on gloo to the ranks behind for host tensors, by a broadcast on the data
backend (NCCL on GPUs) for device ones.  Tensor data is never pickled.  A
replacement (a rank with no state of its own) receives into its own tensors
where the structure matches (the model it built, a tracked EMA); a survivor
one step behind receives into new tensors, so that a transfer that breaks
leaves its own state whole.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agents.recovery import tensor_stream

__all__ = [
    "NO_STATE",
    "SyncResult",
    "agree_on_source",
    "broadcast_state",
    "join_tensors",
    "map_tensors",
    "slots_of",
    "split_tensors",
    "sync_state",
]

log = logging.getLogger(__name__)

NO_STATE = -1


@dataclass(frozen=True)
class SyncResult:
    """What a sync decided."""

    source_rank: int
    step: int
    loaded: bool
    steps_seen: list[int]


def agree_on_source(
    my_step: int, group: dist.ProcessGroup | None = None
) -> tuple[int, int, list[int]]:
    """All-gather every rank's step; return (source rank, its step, all steps).

    ``group`` is a CPU (gloo) group: the generation's control group under NCCL,
    or a part of the ranks (a site's).  The source is a global rank; the steps
    are in the group's rank order.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([my_step], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    steps = [int(t.item()) for t in gathered]
    best = max(steps)
    src = steps.index(best)
    return (src if group is None else dist.get_global_rank(group, src)), best, steps


def sync_state(
    my_step: int,
    capture: Any,
    restore: Any,
    group: dist.ProcessGroup | None = None,
    data_group: dist.ProcessGroup | None = None,
    shared: Callable[[tuple[Any, ...]], bool] | None = None,
) -> SyncResult:
    """Make every rank hold the freshest live state.

    Args:
        my_step: this rank's completed steps, or ``NO_STATE`` (-1) for a fresh process.
        capture: ``() -> object`` returning this rank's state (called on the source, on
            the other ranks at its step when ``shared`` is given, and on a fresh rank
            behind it for the tensors to receive into).
        restore: ``(object) -> None`` loading a state (called on ranks behind the source).
        group: the gloo group to use (None: the default group, which must be gloo);
            a part of the ranks syncs among itself.
        data_group: the group device tensors travel on (None: the default group):
            the same ranks as ``group``, on the data backend.
        shared: whether the tensor at a path of the captured state is the same on
            every rank at one step (a DDP model's parameters and optimizer state):
            every rank at the most advanced step then sends a share of those host
            tensors, at once (:func:`broadcast_state`'s ``helpers``).

    Returns:
        The decision; ``step == NO_STATE`` when no rank has state (a fresh job).
    """
    src, best, steps = agree_on_source(my_step, group)
    if best == NO_STATE:
        return SyncResult(src, NO_STATE, False, steps)
    if all(s == best for s in steps):
        # Every rank applied the same updates: DDP keeps replicas identical.
        return SyncResult(src, best, False, steps)
    rank = dist.get_rank()
    members = [r if group is None else dist.get_global_rank(group, r) for r in range(len(steps))]
    behind_ranks = [members[r] for r, s in enumerate(steps) if s != best]
    behind = rank in behind_ranks
    helpers = [m for m, s in zip(members, steps, strict=True) if s == best and m != src]
    if shared is None:
        helpers = []
    started = time.perf_counter()
    state = broadcast_state(
        capture if rank == src or rank in helpers else None,
        src,
        group,
        receivers=behind_ranks,
        data_group=data_group,
        # a fresh process has nothing to lose: its own tensors take the bytes
        into=capture() if behind and my_step == NO_STATE else None,
        helpers=helpers,
        shared=shared,
    )
    if behind:
        restore(state)
    log.info(
        "state synced from rank %d at step %d to ranks %s in %.2fs (steps seen %s)",
        src,
        best,
        behind_ranks,
        time.perf_counter() - started,
        steps,
    )
    return SyncResult(src, best, behind, steps)


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor was in the state: its place in the list of tensors sent."""

    device_type: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    index: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def map_tensors(x: Any, fn: Callable[[Any], Any], leaf: type) -> Any:
    """``x`` with ``fn`` applied to every ``leaf`` inside its dicts, lists and tuples."""
    if isinstance(x, leaf):
        return fn(x)
    if isinstance(x, dict):
        return {k: map_tensors(v, fn, leaf) for k, v in x.items()}
    if isinstance(x, list):
        return [map_tensors(v, fn, leaf) for v in x]
    if isinstance(x, tuple):
        return tuple(map_tensors(v, fn, leaf) for v in x)
    return x


def split_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` with every tensor replaced by a :class:`_TensorSlot`, and the tensors.

    Dicts, lists and tuples are walked; anything else is kept as is.
    """
    tensors: list[torch.Tensor] = []

    def slot(t: torch.Tensor) -> _TensorSlot:
        tensors.append(t)
        return _TensorSlot(t.device.type, t.dtype, tuple(t.shape), len(tensors) - 1)

    return map_tensors(state, slot, torch.Tensor), tensors


def join_tensors(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`: each slot becomes its tensor."""
    return map_tensors(skeleton, lambda x: tensors[x.index], _TensorSlot)


def slots_of(skeleton: Any) -> list[_TensorSlot]:
    """The skeleton's slots in the order of their tensors."""
    found: list[_TensorSlot] = []
    map_tensors(skeleton, found.append, _TensorSlot)
    return sorted(found, key=lambda x: x.index)


def _device_for(slot: _TensorSlot) -> torch.device:
    """Where a receiver keeps a slot's tensor: its current GPU, or the host."""
    if slot.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _in_place(skeleton: Any, mine: Any, found: dict[int, torch.Tensor]) -> None:
    """Collect the tensors of ``mine`` (a receiver's own state) that a slot at the same
    place in ``skeleton`` can be received into: same shape, dtype and device, contiguous."""
    if isinstance(skeleton, _TensorSlot):
        if (
            isinstance(mine, torch.Tensor)
            and tuple(mine.shape) == skeleton.shape
            and mine.dtype == skeleton.dtype
            and mine.device == _device_for(skeleton)
            and mine.is_contiguous()
        ):
            found[skeleton.index] = mine.detach()
    elif isinstance(skeleton, dict) and isinstance(mine, dict):
        for k, v in skeleton.items():
            if k in mine:
                _in_place(v, mine[k], found)
    elif isinstance(skeleton, (list, tuple)) and isinstance(mine, (list, tuple)):
        for v, m in zip(skeleton, mine, strict=False):
            _in_place(v, m, found)


def broadcast_state(
    capture: Callable[[], Any] | None,
    src: int,
    group: dist.ProcessGroup | None,
    *,
    receivers: Sequence[int] | None = None,
    data_group: dist.ProcessGroup | None = None,
    into: Any = None,
    chunk_bytes: int = tensor_stream.CHUNK_BYTES,
    helpers: Sequence[int] = (),
    shared: Callable[[tuple[Any, ...]], bool] | None = None,
) -> Any:
    """Send the source's captured state to ``receivers``: collective on ``group``.

    The structure is pickled on ``group`` (gloo) to every rank; the tensors
    travel without a copy of the whole (:func:`~agents.recovery.tensor_stream.transfer`):
    host tensors point to point on ``group`` to the receivers only, device
    tensors by a broadcast on ``data_group`` (the default group unless given).
    A receiver allocates each tensor from the structure, on its own current
    device, unless ``into`` holds one to receive it into.

    Args:
        capture: ``() -> object``, the state (on the source and the helpers; None
            elsewhere).
        src: the source rank.
        group: the gloo group of the structure and the host tensors.
        receivers: the ranks that take the state (None: every rank but ``src``).
        data_group: the group of the device tensors' broadcast (None: the default
            group); every rank of ``group`` is in it, and only those.
        into: a receiver's own state of the same structure: each of its tensors
            whose place, shape, dtype and device match is overwritten with the
            source's instead of allocating one (it is left part-written if the
            transfer fails).
        chunk_bytes: the most bytes of one message (and of a staging buffer).
        helpers: other ranks that hold the same state (``capture`` given there too):
            the host tensors ``shared`` says are the same everywhere are sent a share
            by each of them and the source at once, whole tensors balanced by bytes
            (:func:`~agents.recovery.tensor_stream.transfer_from`); the rest, and
            every device tensor, come from the source.  A helper whose tensors there do
            not sit at the source's paths with its shapes, dtypes and devices sends none.
        shared: whether the tensor at a path (keys and indices) of the state is the
            same on the source and every helper.

    Returns:
        On the source, its captured state (its own tensors); on a receiver, the
        source's state; on any other rank, None.
    """
    rank = dist.get_rank()
    if receivers is None:
        receivers = [r for r in range(dist.get_world_size()) if r != src]
    if set(helpers) & set(receivers) or src in helpers:
        raise ValueError(f"helpers {list(helpers)} must hold the state: not {src} nor a receiver")
    header: list[Any] = [None, None]
    state, tensors, paths = None, None, []
    helping = rank in helpers and bool(receivers)
    if rank == src or helping:
        assert capture is not None, "the source and its helpers capture their state"
        state = capture()
        skeleton, tensors = split_tensors(state)
        paths = _tensor_paths(state)
        if rank == src:
            common = _shared_slots(tensors, paths, shared) if helpers else {}
            header = [skeleton, common]
    dist.broadcast_object_list(header, src=src, group=group)
    skeleton, common = header
    slots = slots_of(skeleton)
    owners: dict[int, int] = {}
    if common and receivers:  # every rank: the header says so
        mine = (tensors, paths) if helping and tensors is not None else None
        owners = _owners(slots, common, src, mine, group)
    receiving = rank in receivers
    if receiving:
        found: dict[int, torch.Tensor] = {}
        if into is not None:
            _in_place(skeleton, into, found)
        tensors = [
            found[x.index]
            if x.index in found
            else torch.empty(x.shape, dtype=x.dtype, device=_device_for(x))
            for x in slots
        ]
    on_device = [x.device_type == "cuda" for x in slots]
    for device_route in (False, True):  # host tensors first: the same order on every rank
        chosen = [i for i, d in enumerate(on_device) if d == device_route]
        if not chosen:
            continue
        route = (
            tensor_stream.Route(data_group, True, _device_for(slots[chosen[0]]))
            if device_route  # the data backend (NCCL on GPUs) broadcasts device tensors
            else tensor_stream.Route(group, False, torch.device("cpu"))
        )
        senders = [owners.get(i, src) for i in chosen]
        party = rank in senders or receiving
        tensor_stream.transfer_from(
            senders,
            [tensors[i] for i in chosen] if tensors is not None and party else None,
            [slots[i].nbytes for i in chosen],
            receivers,
            route,
            chunk_bytes,
        )
    if rank == src:
        return state
    if helping:
        return None  # a helper sends its share and takes nothing
    return join_tensors(skeleton, tensors) if tensors is not None else None


def _tensor_paths(x: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path (keys and indices) of each tensor of ``x``, in :func:`split_tensors`' order."""
    if isinstance(x, torch.Tensor):
        return [path]
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in _tensor_paths(v, (*path, k))]
    if isinstance(x, (list, tuple)):
        return [p for i, v in enumerate(x) for p in _tensor_paths(v, (*path, i))]
    return []


def _shared_slots(
    tensors: Sequence[torch.Tensor],
    paths: Sequence[tuple[Any, ...]],
    shared: Callable[[tuple[Any, ...]], bool] | None,
) -> dict[int, tuple[Any, ...]]:
    """The slots (tensor index → path) of the host tensors ``shared`` says every helper
    holds too.  Device tensors travel by the data backend's broadcast, from one source."""
    if shared is None:
        return {}
    return {i: p for i, p in enumerate(paths) if shared(p) and tensors[i].device.type == "cpu"}


def _owners(
    slots: Sequence[_TensorSlot],
    common: dict[int, tuple[Any, ...]],
    src: int,
    mine: tuple[Sequence[torch.Tensor], Sequence[tuple[Any, ...]]] | None,
    group: dist.ProcessGroup | None,
) -> dict[int, int]:
    """Which rank sends each slot of ``common``: the source and every helper whose tensors
    there sit at the same paths with the source's shapes, dtypes and devices (``mine``:
    a helper's tensors and their paths), each a share of the bytes (largest tensors
    first, each to the sender with the fewest bytes so far).  Every rank of ``group``
    calls this (one small gather), and all take the senders from what the gather told.
    """
    rank = dist.get_rank()
    fits = mine is not None and all(
        i < len(mine[0])
        and mine[1][i] == path
        and tuple(mine[0][i].shape) == slots[i].shape
        and mine[0][i].dtype == slots[i].dtype
        and mine[0][i].device.type == slots[i].device_type
        for i, path in common.items()
    )
    told: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, (rank, fits), group=group)
    senders = [src, *sorted(r for r, ok in told if ok and r != src)]
    load = dict.fromkeys(senders, 0)
    owners: dict[int, int] = {}
    for i in sorted(common, key=lambda i: (-slots[i].nbytes, i)):
        owner = min(senders, key=lambda r: (load[r], senders.index(r)))
        owners[i] = owner
        load[owner] += slots[i].nbytes
    if len(senders) > 1 and rank == src:
        shares = ", ".join(f"rank {r} {load[r]:,} bytes" for r in senders)
        log.warning("the tensors the ranks hold alike are sent in shares: %s", shares)
    return owners
