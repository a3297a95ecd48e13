"""The step boundary's vote: a few integers every rank agrees on before the next step.

Each rank fills a :class:`Proposal` from what it knows (the newest generation
its plan watcher saw, the control record, how long since the last periodic
save, whether etcd answers) and :func:`agree` all-reduces it with ``MAX``.
Every rank then acts on the same :class:`Agreement`, so planned changes
(drain, scale, checkpoint-now, stop, a periodic save by time) happen at the
same step on every rank, even when only one rank has heard of them yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Indices of the vector all-reduced (MAX) at every step boundary.
_GENERATION, _CHECKPOINT, _SEEN, _STOP, _ETCD_LOST, _SAVE_DUE, _LEN = range(7)


@dataclass(frozen=True)
class Proposal:
    """What one rank knows at a step boundary."""

    #: newest generation this rank's plan watcher has seen
    generation: int
    #: checkpoint requests the controller has made so far (a counter)
    checkpoint_requested: int
    #: checkpoint requests this rank has served
    checkpoint_served: int
    #: the controller asks the job to stop
    stop: bool
    #: this rank has not heard from etcd for longer than it may
    etcd_lost: bool
    #: ``checkpoint.every_seconds`` have passed since this rank's last periodic save
    save_due_by_time: bool


@dataclass(frozen=True)
class Agreement:
    """What every rank decides at the boundary (the MAX over all proposals)."""

    generation: int
    checkpoint_requested: int
    checkpoint_served: int
    stop: bool
    etcd_lost: bool
    save_due_by_time: bool

    @property
    def checkpoint_request_new(self) -> bool:
        """A request no rank has served yet (a replacement has seen none, its peers have)."""
        return self.checkpoint_requested > self.checkpoint_served

    def periodic_save_due(self, step: int, every_steps: int) -> bool:
        """``every_steps`` divides ``step``, or ``every_seconds`` passed on some rank."""
        return bool(every_steps and step % every_steps == 0) or self.save_due_by_time


def agree(mine: Proposal, group: dist.ProcessGroup | None = None) -> Agreement:
    """All-reduce ``mine`` with every rank's (a collective: every rank calls it).

    ``group`` is the generation's gloo control group under NCCL, so the
    boundary never waits on the GPU stream (None: the default group).
    """
    vec = torch.zeros(_LEN, dtype=torch.int64)
    vec[_GENERATION] = mine.generation
    vec[_CHECKPOINT] = mine.checkpoint_requested
    vec[_SEEN] = mine.checkpoint_served
    vec[_STOP] = int(mine.stop)
    vec[_ETCD_LOST] = int(mine.etcd_lost)
    vec[_SAVE_DUE] = int(mine.save_due_by_time)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    return Agreement(
        generation=int(vec[_GENERATION]),
        checkpoint_requested=int(vec[_CHECKPOINT]),
        checkpoint_served=int(vec[_SEEN]),
        stop=bool(vec[_STOP]),
        etcd_lost=bool(vec[_ETCD_LOST]),
        save_due_by_time=bool(vec[_SAVE_DUE]),
    )
