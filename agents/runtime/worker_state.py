"""Where one worker stands: the record its session owns (runs in the training process).

Only :class:`~agents.runtime.Session` writes it.  The runtime's parts read it
as an :class:`agents.api.WorkerView` and return what changed (a generation
joined, a step restored, a checkpoint resumed); the session applies the
result.  The heartbeat thread reads it to publish the worker's progress.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from agents.api import Stateful
from orchestrator.state.records import Plan, ProgressRecord, Telemetry

__all__ = ["WorkerState"]


@dataclass
class WorkerState:
    """One worker's place in the job, its step and what it trains."""

    #: global rank in the current generation (-1: none joined yet)
    rank: int = -1
    #: ranks in the current generation
    world_size: int = 0
    #: the generation joined last (0: none yet)
    generation: int = 0
    #: the current generation's plan
    plan: Plan | None = None
    #: steps completed: the step trained next
    step: int = 0
    #: the tracked objects hold the state of ``step`` (False: a spare, a fresh job)
    has_state: bool = False
    #: what the script tracked, by name
    tracked: dict[str, Stateful] = field(default_factory=dict)
    #: the current generation's comm hook (None: plain DDP, or between generations)
    hook: Any = None
    #: generations left because of a failure (planned changes are not counted)
    recoveries: int = 0
    #: seconds the last recovery took, from leaving a generation to joining the next
    last_recovery_s: float | None = None
    #: the durable checkpoint the state was last resumed from, if any
    restored_from: str | None = None
    #: why training waits (an etcd outage), while it does
    paused: str | None = None

    def progress(
        self,
        beat: float,
        step_time: float,
        *,
        metrics: dict[str, float],
        telemetry: Telemetry,
        joining: tuple[int, int, int] | None = None,
        uploading: tuple[int, float] | None = None,
    ) -> ProgressRecord:
        """This worker's progress as of ``beat`` (its heartbeat publishes it).

        Args:
            beat: now (wall clock).
            step_time: when the step counter last moved.
            metrics: the script's last reported metrics.
            telemetry: the worker's timings and totals.
            joining: ``(generation, rank, world size)`` of a generation being
                joined: the record names it already.
            uploading: ``(step, wall-clock start)`` of a save still uploading.
        """
        generation, rank, world_size = joining or (self.generation, self.rank, self.world_size)
        return ProgressRecord(
            step=self.step,
            generation=generation,
            rank=rank,
            world_size=world_size,
            pid=os.getpid(),
            beat=beat,
            step_time=step_time,
            recoveries=self.recoveries,
            last_recovery_s=self.last_recovery_s,
            paused=self.paused,
            metrics=dict(metrics),
            telemetry=telemetry,
            uploading=uploading,
        )
