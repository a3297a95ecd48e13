"""The checkpoint's own gloo process groups, and collectives that also work alone.

Checkpoint coordination never shares a process group with training: training
collectives may be NCCL, may be in flight on another stream, or may be
reformed after a failure.  :class:`Coordination` creates two gloo groups over
the same ranks as the training group: ``control`` is used by the training
thread (agreeing to save, restore), ``upload`` only by the background upload
thread, so the two never interleave collectives on one group.  Every
collective is bounded by the groups' timeout.

Without an initialised ``torch.distributed`` (a single process), the
collectives degenerate to local operations.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from checkpoint.api import DEFAULT_COLLECTIVE_TIMEOUT, CheckpointPeerError


class Coordination:
    """Rank, world size and the two gloo groups of the checkpoint.

    Args:
        group: the training process group whose ranks save together
            (default: the whole world).  Creating groups is collective: every
            rank of the world must construct its ``Coordination`` together.
        timeout: bound on every collective of the checkpoint groups.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
    ) -> None:
        self.timeout = timeout
        self.distributed = dist.is_available() and dist.is_initialized()
        self.control: dist.ProcessGroup | None = None
        self.upload: dist.ProcessGroup | None = None
        if not self.distributed:
            self.rank, self.world_size = 0, 1
            return
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        self.control = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        self.upload = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        self.rank = dist.get_rank(self.control)
        self.world_size = dist.get_world_size(self.control)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
        """Every rank's ``obj``, in rank order.

        Raises:
            CheckpointPeerError: the collective failed (a rank is gone).
        """
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=group)
        except RuntimeError as e:  # gloo's transport errors, DistError included
            raise CheckpointPeerError(f"a checkpoint all-gather failed: {e}") from e
        return out

    def broadcast(self, obj: Any, group: dist.ProcessGroup | None, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank.

        Raises:
            CheckpointPeerError: the collective failed (a rank is gone).
        """
        if not self.distributed:
            return obj
        box = [obj]
        try:
            dist.broadcast_object_list(box, group_src=src, group=group)
        except RuntimeError as e:
            raise CheckpointPeerError(f"a checkpoint broadcast failed: {e}") from e
        return box[0]

    def all_true(self, flag: bool, group: dist.ProcessGroup | None) -> bool:
        """True when ``flag`` is true on every rank."""
        return all(self.all_gather(bool(flag), group))
