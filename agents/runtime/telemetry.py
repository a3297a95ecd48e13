"""What a worker measures about itself, published with its progress heartbeat.

The controller turns these figures into metrics and recovery timings, so the
worker only records wall-clock timestamps and running totals:

* per generation: when the process group was formed, when the state was
  restored (and at which step, from what source, with how many completed
  steps lost: what the join's recovery returned, :class:`~agents.state.api.Restored`),
  and when the first step of the generation completed; the controller splits
  a recovery into detect / rendezvous / restore / first step from them;
* durable checkpoints: how long the training loop was blocked by the last
  save and how long its upload took, and the running total of the time saves
  blocked it between this process's first and latest completed steps (the
  controller's checkpoint-stall line, :mod:`orchestrator.observe.training_time`);
* gradient exchange: bytes this rank put on the wire and the dense fp32
  bytes they stand for (their ratio is the compression ratio).  Without a
  comm hook DDP sends every gradient dense, so wire bytes equal dense bytes;
* step timing: running totals of the time its steps computed and waited for
  their peers (:mod:`agents.runtime.step_timing`), from which the controller
  tells a slow node from its peers;
* what the session's step participants report of themselves
  (:meth:`~agents.runtime.participants.StepParticipant.telemetry`): a delayed
  sync's outer steps, the bytes that came from other sites, the time it
  waited for outer results.

Timestamps are ``time.time()``: the controller compares them with its own
clock and other workers', which is exact on one machine and as good as the
hosts' clock synchronisation elsewhere.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from agents.runtime.device_timing import step_timing_for
from agents.runtime.step_timing import StepTiming
from orchestrator.state.records import Telemetry

__all__ = ["WorkerTelemetry"]


class WorkerTelemetry:
    """Timestamps and totals of one worker process (see the module docstring).

    Args:
        timed: time the steps (``fault_tolerance.stragglers.action`` is not ``off``);
            without it the step loop reads no clock for them and the totals stay 0.
        device: where the worker trains: a CUDA device's steps are timed from CUDA
            events (:mod:`agents.runtime.device_timing`), others from the host's clock.
    """

    def __init__(self, timed: bool = True, device: torch.device | None = None) -> None:
        self.generation = 0
        self.group_formed_at: float | None = None
        self.restored_at: float | None = None
        self.restored_step: int | None = None
        self.first_step_at: float | None = None
        self.checkpoint_blocking_s: float | None = None
        self.checkpoint_upload_s: float | None = None
        #: seconds saves blocked the loop: all of them, and as of the first and the
        #: latest completed step (what is published: the stalls between those steps)
        self._stalled = 0.0
        self._stalled_at_first: float | None = None
        self._stalled_at_latest = 0.0
        self.wire_bytes = 0
        self.dense_bytes = 0
        #: what ended this worker's last failed generation: ``error`` (a collective
        #: raised), ``timeout`` or ``abort`` (see :mod:`agents.runtime.collective_guard`)
        self.left_by: str | None = None
        #: this rank's compute and wait time per step (fed by the comm hooks and a
        #: sharded model's collectives), if timed
        self.timing: StepTiming | None = step_timing_for(device) if timed else None
        #: where the state of the current generation came from (a sharded model's
        #: ``twin``, ``buddy``, ``durable``...; None: not told) and the completed steps lost
        self.restored_from: str | None = None
        self.steps_lost = 0

    # -- generation timeline -----------------------------------------------------------

    def group_formed(self, generation: int) -> None:
        self.generation = generation
        self.group_formed_at = time.time()
        self.restored_at = None
        self.restored_step = None
        self.first_step_at = None
        self.restored_from = None
        self.steps_lost = 0
        if self.timing is not None:
            self.timing.reset()

    def state_source(self, source: str | None, lost: int) -> None:
        """The generation's state came from ``source``; ``lost`` completed steps were lost."""
        self.restored_from = source
        self.steps_lost = lost

    def state_restored(self, step: int) -> None:
        self.restored_at = time.time()
        self.restored_step = step

    def step_done(self, hook: Any, modules: Iterable[nn.Module]) -> None:
        """A step of the current generation completed; count its gradient bytes."""
        if self.first_step_at is None:
            self.first_step_at = time.time()
        if self._stalled_at_first is None:
            self._stalled_at_first = self._stalled
        self._stalled_at_latest = self._stalled
        if self.timing is not None:
            self.timing.step_done()
        last = getattr(getattr(hook, "metrics", None), "last", None)
        if last is not None:
            self.wire_bytes += int(last.wire_bytes)
            self.dense_bytes += 4 * int(last.numel)
            return
        dense = 4 * sum(p.numel() for m in modules for p in m.parameters() if p.requires_grad)
        self.wire_bytes += dense
        self.dense_bytes += dense

    # -- checkpoints -------------------------------------------------------------------

    def checkpoint_blocked(self, seconds: float) -> None:
        """A save returned to the loop after blocking it ``seconds``."""
        self.checkpoint_blocking_s = round(seconds, 6)
        self._stalled += seconds

    def checkpoint_failed(self, seconds: float) -> None:
        """A save failed after blocking the loop ``seconds`` (a stall, not a save's time)."""
        self._stalled += seconds

    @property
    def checkpoint_stall_s(self) -> float:
        """Seconds saves blocked the loop between the first and the latest completed step."""
        if self._stalled_at_first is None:
            return 0.0
        return self._stalled_at_latest - self._stalled_at_first

    def checkpoint_uploaded(self, seconds: float | None) -> None:
        if seconds is not None:
            self.checkpoint_upload_s = round(seconds, 6)

    def record(self, *more: Mapping[str, Any]) -> Telemetry:
        """The figures as the record published in the worker's progress.

        Args:
            more: fields of the record that others measure (the session's step
                participants: :meth:`~agents.runtime.participants.StepParticipant.telemetry`).
        """
        timing = self.timing
        record = Telemetry(
            generation=self.generation,
            group_formed_at=self.group_formed_at,
            restored_at=self.restored_at,
            restored_step=self.restored_step,
            first_step_at=self.first_step_at,
            checkpoint_blocking_s=self.checkpoint_blocking_s,
            checkpoint_upload_s=self.checkpoint_upload_s,
            checkpoint_stall_s=round(self.checkpoint_stall_s, 6),
            wire_bytes=self.wire_bytes,
            dense_bytes=self.dense_bytes,
            left_by=self.left_by,
            compute_s=round(timing.compute_s, 6) if timing is not None else 0.0,
            wait_s=round(timing.wait_s, 6) if timing is not None else 0.0,
            timed_steps=timing.steps if timing is not None else 0,
            restored_from=self.restored_from,
            steps_lost=self.steps_lost,
        )
        for fields in more:
            record = dataclasses.replace(record, **fields)
        return record
