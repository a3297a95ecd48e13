"""Bring every rank of a new generation to the most advanced live state.

After a failure the survivors may disagree by at most one step: a collective
can complete on some ranks (every contribution arrived, so their update is
correct) and fail on others.  A replacement has no state at all.  The rule is
simple: the rank with the highest step (lowest rank among equals) broadcasts
its state; everybody behind it loads it.  Each step is therefore applied
exactly once, and no completed step is lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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

    ``group`` is a CPU (gloo) group: the generation's control group under NCCL.
    """
    world = dist.get_world_size()
    mine = torch.tensor([my_step], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    steps = [int(t.item()) for t in gathered]
    best = max(steps)
    return steps.index(best), best, steps


def sync_state(
    my_step: int, capture: Any, restore: Any, group: dist.ProcessGroup | None = None
) -> SyncResult:
    """Make every rank hold the freshest live state.

    Args:
        my_step: this rank's completed steps, or ``NO_STATE`` (-1) for a fresh process.
        capture: ``() -> object`` returning this rank's state (called on the source only).
        restore: ``(object) -> None`` loading a state (called on ranks behind the source).
        group: the gloo group to use (None: the default group, which must be gloo).

    Returns:
        The decision; ``step == NO_STATE`` when no rank has state (a fresh job).
    """
    src, best, steps = agree_on_source(my_step, group)
    if best == NO_STATE:
        return SyncResult(src, NO_STATE, False, steps)
    if all(s == best for s in steps):
        # Every rank applied the same updates: DDP keeps replicas identical.
        return SyncResult(src, best, False, steps)
    payload: list[Any] = [capture() if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    behind = steps[dist.get_rank()] != best
    if behind:
        restore(payload[0])
    log.info("state synced from rank %d at step %d (steps seen %s)", src, best, steps)
    return SyncResult(src, best, behind, steps)
