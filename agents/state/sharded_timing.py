"""Timing a sharded model's steps: FSDP2's own collectives, each one's duration a wait.

Runs inside the training process.  FSDP2 (``fully_shard``, and so ``hsdp``
and meshes) runs no DDP comm hook: it all-gathers each parameter group before
its forward (and again before its backward when it resharded), reduce-scatters
the gradients after the backward, and under HSDP all-reduces the reduced
shard across the replicas.  A rank that reaches one of these before a slow
peer waits in it; a slow rank finds its peers there and hardly waits.

FSDP2 lets a module swap the collectives it calls for its own
(``FSDPModule.set_custom_all_gather`` and ``set_custom_reduce_scatter``, public
since torch 2.8) and call a hook right after the replica all-reduce
(``set_all_reduce_hook``).  :func:`time_collectives` installs collectives that
do what FSDP2's defaults do (the same ``torch.distributed`` call, the same
buffers) between :meth:`CollectiveTiming.collective_started`
and :meth:`CollectiveTiming.collective_ended`; under HSDP
the all-reduce is timed from the end of the reduce-scatter that precedes it
to the hook (between the two FSDP2 only divides the gradient).  Why these and
not the alternatives:

* module forward hooks see the forward's all-gathers only, and FSDP2 runs its
  backward collectives from autograd hooks no module hook brackets;
* NCCL's completion hook (``ProcessGroup._register_on_completion_hook``) exists
  only for NCCL and times every collective of the group (the runtime's own
  votes, state syncs and buddy copies too);
* wrapping the process group or patching ``torch.distributed`` changes torch
  for every caller.

The swapped collectives are FSDP2's own calls, so a failure inside them is
still raised in FSDP2's frames (:func:`~agents.runtime.failures.raised_in_collective`).

On the host's clock (gloo) a collective FSDP2 calls without ``async_op``
returns when it is done, so its call's length is its wait.  On a GPU the same
brackets are CUDA events on the collective's stream
(:mod:`agents.runtime.device_timing`): the collective's own duration on the
device.  An all-gather FSDP2 issues with ``async_op`` (explicit prefetching,
which the runtime does not ask for) is left untimed: FSDP2 waits for it later,
out of sight.  Not timed either: a mesh's tensor-parallel collectives (within
a node: its ranks are slow together) and a pipeline's sends and receives
between stages.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CollectiveTiming", "TimedAllGather", "TimedReduceScatter", "time_collectives"]

log = logging.getLogger("ringmaster.worker")


class CollectiveTiming(Protocol):
    """What the timed collectives feed: the worker's step timing
    (:class:`~agents.runtime.step_timing.StepTiming` is one)."""

    def collective_started(self) -> Any:
        """A collective starts; the result goes to :meth:`collective_ended`."""
        ...

    def collective_ended(self, started: Any) -> None:
        """The collective begun at ``started`` returned: all of it was a wait."""
        ...


try:  # the contracts of FSDP2's custom collectives (torch 2.8 and later)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - torch 2.7: sharded steps stay untimed
    AllGather = ReduceScatter = object  # type: ignore[assignment,misc]


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool) -> Any:
    # torch 2.13 calls it all_gather_single and deprecates the older name
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def _reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: Any, op: Any, async_op: bool
) -> Any:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)


class _Allocating:
    """FSDP2's default buffers: a plain ``torch.empty`` per call."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class TimedAllGather(_Allocating, AllGather):
    """FSDP2's all-gather, its duration counted as this step's wait."""

    def __init__(self, timing: CollectiveTiming) -> None:
        self.timing = timing

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        if async_op:  # waited for later, where no one sees it: not timed
            return _all_gather(output_tensor, input_tensor, group, True)
        started = self.timing.collective_started()
        work = _all_gather(output_tensor, input_tensor, group, False)
        self.timing.collective_ended(started)
        return work


class TimedReduceScatter(_Allocating, ReduceScatter):
    """FSDP2's reduce-scatter, its duration counted as this step's wait; under HSDP
    it marks where the replica all-reduce that follows starts (:meth:`replicas_reduced`).

    Args:
        timing: the step timing fed.
        sharded: the shard group has more than one rank (else FSDP2 copies instead of
            calling the reduce-scatter, and the all-reduce's start is marked when it
            takes the buffer it copies into).
        replicated: HSDP: an all-reduce across the replicas follows each reduce-scatter.
    """

    def __init__(
        self, timing: CollectiveTiming, sharded: bool = True, replicated: bool = False
    ) -> None:
        self.timing = timing
        self.sharded = sharded
        self.replicated = replicated
        self._mark: Any = None

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if self.replicated and not self.sharded:  # the output buffer: taken just before
            # the copy that stands for the reduce-scatter, and the all-reduce
            self._mark = self.timing.collective_started()
        return super().allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        if async_op:
            return _reduce_scatter(output_tensor, input_tensor, group, op, True)
        started = self.timing.collective_started()
        work = _reduce_scatter(output_tensor, input_tensor, group, op, False)
        self.timing.collective_ended(started)
        if self.replicated:
            self._mark = self.timing.collective_started()  # the all-reduce starts here
        return work

    def replicas_reduced(self, reduced: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: the replica all-reduce just ended."""
        mark, self._mark = self._mark, None
        if mark is not None:
            self.timing.collective_ended(mark)


def time_collectives(
    module: nn.Module, timing: CollectiveTiming, *, shards: int, replicas: int
) -> bool:
    """Time the collectives of every ``fully_shard``-ed module in ``module``.

    Args:
        module: a module after ``fully_shard`` (before its first forward).
        timing: the worker's step timing.
        shards: ranks of a shard group; replicas: shard groups (HSDP: more than 1).

    Returns:
        False when this torch has no custom FSDP2 collectives (torch 2.7) or a module
        shards its parameters on several meshes: its steps stay untimed (logged once).
    """
    fsdp = [m for m in module.modules() if hasattr(m, "set_custom_all_gather")]
    if not fsdp or AllGather is object:
        log.info("sharded steps are not timed: this torch has no custom FSDP2 collectives")
        return False
    for m in fsdp:
        scatter = TimedReduceScatter(timing, sharded=shards > 1, replicated=replicas > 1)
        try:
            m.set_custom_all_gather(TimedAllGather(timing))  # type: ignore[operator]
            m.set_custom_reduce_scatter(scatter)  # type: ignore[operator]
            if replicas > 1:
                m.set_all_reduce_hook(scatter.replicas_reduced)  # type: ignore[operator]
        except ValueError as e:  # several parameter groups (a per-parameter mesh)
            log.info("sharded steps are not timed: %s", e)
            return False
    return True
