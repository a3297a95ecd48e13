"""A replica's ranks apply a step's optimizer update together, or none of them does.

Runs in the training process.  The ranks of one replica of a sharded model
(an HSDP shard group; a mesh's pipeline x shard x tensor ranks) each hold a
different slice, and a slice is only worth something at the same step as the
others.  A node loss can end a step for one of them and not another: the
cross-replica gradient reduce of one rank completes just before the dead node
goes, its neighbour's does not.  Had the first applied its optimizer step, the
survivors would hold slices of two different steps, no complete set would be
left, and the job would go back to its durable checkpoint.

So before a tracked optimizer steps, the replica's ranks meet in a one-number
all-reduce on a gloo group of their own (:meth:`ReplicaBarrier.attach` puts it
in an optimizer step pre-hook).  A rank whose step failed never arrives, and
leaving its groups makes the others' all-reduce fail: their step fails too,
before any update, and every survivor holds the same step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ReplicaBarrier"]


class ReplicaBarrier:
    """The replica group of the current generation, met before each optimizer step."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self._hooked: set[int] = set()
        self._handles: list[Any] = []
        self.met = 0

    def form(self, rank: int, world_size: int, replica_size: int) -> None:
        """Make the generation's replica groups (every rank calls, in the same order)."""
        self.group = None
        if replica_size <= 1:
            return
        for first in range(0, world_size, replica_size):
            ranks = list(range(first, min(first + replica_size, world_size)))
            group = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                self.group = group

    def attach(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        """Meet the replica before each of ``optimizers`` steps (once per optimizer)."""
        for opt in optimizers.values():
            if id(opt) not in self._hooked:
                self._hooked.add(id(opt))
                self._handles.append(opt.register_step_pre_hook(self._meet))

    def _meet(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.group is None:
            return
        dist.all_reduce(torch.zeros(1), group=self.group)
        self.met += 1
