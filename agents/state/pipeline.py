"""Pipeline stages for ``wrap(mesh={"pipeline": P, ...}, pipeline=Pipeline(...))``.

Runs in the training process.  The model is an ``nn.Sequential``; its
children are cut into ``P`` contiguous stages (at the names the script gives,
else balanced by parameter count), and each rank of a replica's ``pipeline``
dimension holds one stage: an ``nn.Sequential`` of those children under their
own names, so every parameter keeps its name in the whole model (durable
checkpoints of any layout resume into any other).  Each stage may itself be
tensor parallel and sharded (FSDP2) like a whole model.

:class:`PipelineRunner` drives ``torch.distributed.pipelining``'s schedules
(GPipe or 1F1B) over the generation's pipeline group: the first stage takes
the inputs, the last the targets, and every rank gets the step's loss back.
The stage and its schedule are rebuilt with each generation, as the sharded
module is.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

__all__ = ["SCHEDULES", "Pipeline", "PipelineRunner", "split_stages", "stage_of"]

#: The schedules ``Pipeline(schedule=...)`` takes.
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True)
class Pipeline:
    """How a pipelined model is cut and run.

    Attributes:
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, on the last
            stage; as in ``torch.distributed.pipelining``, the gradients are
            averaged over the micro-batches.
        microbatches: micro-batches each step's batch is cut into (dimension 0).
        schedule: ``gpipe`` (all forwards, then all backwards) or ``1f1b``
            (one forward, one backward: less activation memory; needs at least
            as many micro-batches as stages).
        split: names of the children where stages 2, 3, ... begin (P - 1 of
            them, in order); None: balanced by parameter count.
    """

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    microbatches: int = 4
    schedule: str = "1f1b"
    split: tuple[str, ...] | None = None

    def check(self, stages: int) -> None:
        """Raise unless the settings can run ``stages`` stages.

        Raises:
            ValueError: naming the setting and what is valid.
        """
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"Pipeline(schedule={self.schedule!r}) is not a schedule; use one of "
                + ", ".join(map(repr, SCHEDULES))
            )
        if self.microbatches < 1:
            raise ValueError(f"Pipeline(microbatches={self.microbatches}) must be 1 or more")
        if self.schedule == "1f1b" and self.microbatches < stages:
            raise ValueError(
                f"Pipeline(schedule='1f1b') needs at least as many micro-batches as stages: "
                f"microbatches={self.microbatches}, {stages} stages; raise microbatches or "
                "use schedule='gpipe'"
            )


def split_stages(model: nn.Module, stages: int, split: tuple[str, ...] | None) -> list[list[str]]:
    """The children of ``model`` each stage holds, in order.

    Raises:
        ValueError: ``model`` is not an ``nn.Sequential``, has fewer children than
            stages, or ``split`` does not name ``stages - 1`` of its children in order.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"a pipeline cuts an nn.Sequential into stages; this model is "
            f"{type(model).__name__}: build it as nn.Sequential(embedding, *blocks, head)"
        )
    names = [name for name, _ in model.named_children()]
    if len(names) < stages:
        raise ValueError(f"mesh pipeline={stages} but the model has {len(names)} children")
    if split is None:
        cuts = _balanced(model, names, stages)
    else:
        if len(split) != stages - 1 or any(s not in names for s in split):
            raise ValueError(
                f"Pipeline(split={list(split)!r}) must name {stages - 1} of the model's "
                f"children {names} where stages 2..{stages} begin"
            )
        cuts = [names.index(s) for s in split]
        if cuts != sorted(set(cuts)) or cuts[0] == 0:
            raise ValueError(
                f"Pipeline(split={list(split)!r}): the names must be in the model's order "
                f"and not its first child {names[0]!r}"
            )
    bounds = [0, *cuts, len(names)]
    return [names[a:b] for a, b in itertools.pairwise(bounds)]


def _balanced(model: nn.Module, names: list[str], stages: int) -> list[int]:
    """Where stages 2.. begin: stage ``k`` begins at the first child past ``k / stages`` of
    the parameters, each stage keeping one child at least."""
    sizes = [sum(p.numel() for p in getattr(model, n).parameters()) for n in names]
    prefix = list(itertools.accumulate(sizes))
    total = prefix[-1] or 1
    cuts: list[int] = []
    for k in range(1, stages):
        lowest = (cuts[-1] if cuts else 0) + 1
        highest = len(names) - (stages - k)
        share = next((i + 1 for i, acc in enumerate(prefix) if acc * stages >= total * k), highest)
        cuts.append(min(max(share, lowest), highest))
    return cuts


def stage_of(whole: nn.Module, children: list[str]) -> nn.Sequential:
    """The stage that holds ``children`` of ``whole`` under their own names."""
    return nn.Sequential(collections.OrderedDict((n, getattr(whole, n)) for n in children))


class PipelineRunner:
    """Runs a pipeline schedule for the stage this rank holds, generation by generation."""

    def __init__(self, pipeline: Pipeline, stages: int) -> None:
        self.pipeline = pipeline
        self.stages = stages
        self._schedule: PipelineScheduleSingle | None = None
        self._stage_index = 0
        self._group: dist.ProcessGroup | None = None
        self._last_rank = 0
        self._device = torch.device("cpu")

    def reset(self, stage: nn.Module, mesh: DeviceMesh, device: torch.device) -> None:
        """A new generation: the schedule for ``stage`` on ``mesh``'s pipeline dimension."""
        pipe = mesh["pipeline"]
        self._stage_index = pipe.get_local_rank()
        self._group = pipe.get_group()
        self._last_rank = dist.get_global_rank(self._group, self.stages - 1)
        # the loss travels where the group's backend takes it: host memory for gloo
        self._device = torch.device("cpu") if dist.get_backend(self._group) == "gloo" else device
        built = PipelineStage(stage, self._stage_index, self.stages, device, group=self._group)
        kind = SCHEDULES[self.pipeline.schedule]
        self._schedule = kind(built, self.pipeline.microbatches, loss_fn=self.pipeline.loss_fn)

    @property
    def stage_index(self) -> int:
        return self._stage_index

    def step(self, inputs: torch.Tensor, target: torch.Tensor, train: bool = True) -> torch.Tensor:
        """Forward and backward of one step's batch (``train``; else forward only, no
        gradients); the mean micro-batch loss, on every rank."""
        if self._schedule is None:
            raise RuntimeError("a pipelined model runs inside session.steps()")
        rows, parts = int(inputs.shape[0]), self.pipeline.microbatches
        if rows % parts:
            raise ValueError(
                f"model.step(): a batch of {rows} rows does not cut into {parts} equal "
                f"micro-batches (Pipeline(microbatches={parts})); give each rank a batch "
                f"that is a multiple of {parts}"
            )
        run = self._schedule.step if train else self._schedule.eval
        losses: list[torch.Tensor] = []
        if self._stage_index == 0:
            run(inputs)
        elif self._stage_index == self.stages - 1:
            run(target=target, losses=losses)
        else:
            run()
        loss = torch.zeros((), device=self._device)
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean().to(self._device)
        dist.broadcast(loss, src=self._last_rank, group=self._group)
        return loss
