"""Bring every rank of a new generation to the most advanced live state.

After a failure the survivors may disagree by at most one step: a collective
can complete on some ranks (every contribution arrived, so their update is
correct) and fail on others.  A replacement has no state at all.  The rule is
simple: the rank with the highest step (lowest rank among equals) broadcasts
its state; everybody behind it loads it.  Each step is therefore applied
exactly once, and no completed step is lost.

The state travels in two parts: its structure (names, small values, each
tensor's shape and dtype) is pickled on the gloo control group, and the
tensors themselves are broadcast as one flat buffer per device and dtype, on
the data backend for device tensors (NCCL on GPUs) and on gloo for host ones.
Large tensors are never pickled.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "NO_STATE",
    "SyncResult",
    "agree_on_source",
    "broadcast_state",
    "join_tensors",
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
    my_step: int, capture: Any, restore: Any, group: dist.ProcessGroup | None = None
) -> SyncResult:
    """Make every rank hold the freshest live state.

    Args:
        my_step: this rank's completed steps, or ``NO_STATE`` (-1) for a fresh process.
        capture: ``() -> object`` returning this rank's state (called on the source only).
        restore: ``(object) -> None`` loading a state (called on ranks behind the source).
        group: the gloo group to use (None: the default group, which must be gloo);
            a part of the ranks syncs among itself (host tensors only).

    Returns:
        The decision; ``step == NO_STATE`` when no rank has state (a fresh job).
    """
    src, best, steps = agree_on_source(my_step, group)
    if best == NO_STATE:
        return SyncResult(src, NO_STATE, False, steps)
    if all(s == best for s in steps):
        # Every rank applied the same updates: DDP keeps replicas identical.
        return SyncResult(src, best, False, steps)
    state = broadcast_state(capture if dist.get_rank() == src else None, src, group)
    behind = steps[dist.get_rank(group)] != best
    if behind:
        restore(state)
    log.info("state synced from rank %d at step %d (steps seen %s)", src, best, steps)
    return SyncResult(src, best, behind, steps)


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor was in the state: its place in a flat buffer."""

    device_type: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def _map_tensors(x: Any, fn: Callable[[Any], Any], leaf: type) -> Any:
    """``x`` with ``fn`` applied to every ``leaf`` inside its dicts, lists and tuples."""
    if isinstance(x, leaf):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn, leaf) for k, v in x.items()}
    if isinstance(x, list):
        return [_map_tensors(v, fn, leaf) for v in x]
    if isinstance(x, tuple):
        return tuple(_map_tensors(v, fn, leaf) for v in x)
    return x


def split_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` with every tensor replaced by a :class:`_TensorSlot`, and the tensors.

    Dicts, lists and tuples are walked; anything else is kept as is.
    """
    tensors: list[torch.Tensor] = []
    offsets: dict[tuple[str, torch.dtype], int] = {}

    def slot(t: torch.Tensor) -> _TensorSlot:
        key = (t.device.type, t.dtype)
        offset = offsets.get(key, 0)
        offsets[key] = offset + t.numel()
        tensors.append(t)
        return _TensorSlot(t.device.type, t.dtype, tuple(t.shape), offset)

    return _map_tensors(state, slot, torch.Tensor), tensors


def join_tensors(skeleton: Any, buffers: dict[tuple[str, torch.dtype], torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`: slots become views of ``buffers``."""

    def view(x: _TensorSlot) -> torch.Tensor:
        flat = buffers[(x.device_type, x.dtype)]
        return flat[x.offset : x.offset + math.prod(x.shape)].view(x.shape)

    return _map_tensors(skeleton, view, _TensorSlot)


def broadcast_state(
    capture: Callable[[], Any] | None, src: int, group: dist.ProcessGroup | None
) -> Any:
    """Broadcast the source's captured state: its structure pickled on ``group`` (gloo),
    its tensors as one flat buffer per (device type, dtype).

    Device tensors go over the default (data) group, host tensors over ``group``;
    a receiver allocates device buffers on its own current device.
    """
    header: list[Any] = [None]
    tensors: list[torch.Tensor] = []
    if capture is not None:
        skeleton, tensors = split_tensors(capture())
        sizes: dict[tuple[str, torch.dtype], int] = {}
        for t in tensors:
            key = (t.device.type, t.dtype)
            sizes[key] = sizes.get(key, 0) + t.numel()
        header = [(skeleton, sizes)]
    dist.broadcast_object_list(header, src=src, group=group)
    skeleton, sizes = header[0]
    buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    for (device_type, dtype), numel in sizes.items():
        device = (
            torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else None
        )
        if capture is not None:
            parts = [  # on one device (a model may span several GPUs)
                t.detach().reshape(-1).to(device or t.device)
                for t in tensors
                if (t.device.type, t.dtype) == (device_type, dtype)
            ]
            flat = torch.cat(parts)
        else:
            flat = torch.empty(numel, dtype=dtype, device=device)
        on = None if device_type == "cuda" else group  # device tensors: the data backend
        if flat.dtype == torch.bool:  # gloo and NCCL reduce no bools; they broadcast bytes
            carrier = flat.view(torch.uint8)
            dist.broadcast(carrier, src=src, group=on)
        else:
            dist.broadcast(flat, src=src, group=on)
        buffers[(device_type, dtype)] = flat
    return join_tensors(skeleton, buffers)
