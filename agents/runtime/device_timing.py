"""Step timing read from the GPU: CUDA events, resolved a few steps late, never waited for.

Runs inside the training process of a CUDA worker.  Under NCCL the host runs
ahead of the device: a collective returns (and its future completes) as soon
as it is queued, so the host's clock reads a wait of about 0 on every rank and
a "compute" equal to the whole step.  :class:`DeviceStepTiming` takes the
moments :class:`~agents.runtime.step_timing.StepTiming` takes, but as CUDA
events recorded on the streams the work runs on:

* the step boundary: an event on the compute stream (the current stream when
  the step loop ends a step), so a step's length is what the device took from
  one boundary to the next: a GPU slowed by heat, by a co-tenant's kernels or
  by its own slow memory shows a longer step;
* DDP's last gradient bucket posted: an event on the stream the backward pass
  runs on (current in the comm hook), i.e. when the device finished the
  gradients of the last bucket;
* its reduction done: an event recorded in the future's callback, whose
  current stream waits for the collective's own end (CUDA futures run their
  callbacks on streams synchronised with the work), so it fires when the
  all-reduce finished on the device, the wait for a slow peer included;
* a sharded model's collective (:mod:`agents.state.sharded_timing`): an
  event before and one after the call on the stream FSDP2 issues it on; the
  stream waits for the collective to end before the second, so the pair spans
  the collective's own duration on the device (what NCCL's timing
  ``TORCH_NCCL_ENABLE_TIMING`` would measure for it, without turning that on
  for every collective of the group).

Nothing is synchronised: each step's events join a queue, and each later step
boundary asks the oldest entries whether their events completed
(``Event.query``) and only then reads their ``elapsed_time``.  The totals lag
the device by the few steps the host runs ahead; a generation's end drops
what has not resolved (its group may be gone).  Events are reused from a
small pool.  The controller's rule is unchanged: only its inputs now say what
the device did.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from agents.runtime.step_timing import StepTiming

__all__ = ["MAX_PENDING", "DeviceStepTiming", "step_timing_for"]

#: Steps whose events may wait to resolve; past it the oldest is dropped untimed
#: (a device more than this many steps behind its host is not a timing question).
MAX_PENDING = 256


@dataclass
class _Step:
    """One step's events: from the previous boundary to this one."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    posted: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def events(self) -> list[torch.cuda.Event]:
        out = [self.start, self.end, *(e for pair in self.spans for e in pair)]
        return out + [e for e in (self.posted, self.done) if e is not None]

    def resolved(self) -> bool:
        return all(e.query() for e in self.events())


class DeviceStepTiming(StepTiming):
    """:class:`StepTiming` read from CUDA events on ``device`` (see the module docstring)."""

    __slots__ = ("_device", "_done_ev", "_end", "_pending", "_pool", "_posted_ev", "_spans")

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = device
        self._pool: list[torch.cuda.Event] = []
        self._pending: deque[_Step] = deque()
        #: the last boundary's event, this step's last bucket posted and reduced
        self._end: torch.cuda.Event | None = None
        self._posted_ev: torch.cuda.Event | None = None
        self._done_ev: torch.cuda.Event | None = None
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def _current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self._device)

    def _record(self, event: torch.cuda.Event | None = None) -> torch.cuda.Event:
        """``event`` (else one from the pool) recorded on the current stream."""
        if event is None:
            event = self._pool.pop() if self._pool else self._new_event()
        event.record(self._current_stream())
        return event

    # -- the moments (see StepTiming) --------------------------------------------------

    def posted(self) -> None:
        # one event per step, recorded again for each bucket: the last record counts
        self._posted_ev = self._record(self._posted_ev)

    def completed(self) -> None:
        self._done_ev = self._record(self._done_ev)

    def collective_started(self) -> Any:
        return self._record()

    def collective_ended(self, started: Any) -> None:
        self._spans.append((started, self._record()))

    def step_done(self) -> None:
        end = self._record()
        start, posted, done, spans = self._end, self._posted_ev, self._done_ev, self._spans
        self._end, self._posted_ev, self._done_ev, self._spans = end, None, None, []
        if start is not None:
            exchanged = posted is not None and done is not None
            if exchanged or spans:
                step = _Step(start, end, spans=spans)
                if exchanged:
                    step.posted, step.done = posted, done
                self._pending.append(step)
                if len(self._pending) > MAX_PENDING:
                    self._pending.popleft()  # dropped untimed (its events are not reused)
        self.resolve()

    def resolve(self) -> int:
        """Add the steps whose events have completed, oldest first; how many were added."""
        added = 0
        while self._pending and self._pending[0].resolved():
            step = self._pending.popleft()
            length = step.start.elapsed_time(step.end) / 1000.0
            wait = sum(a.elapsed_time(b) for a, b in step.spans) / 1000.0
            if step.posted is not None and step.done is not None:
                wait += step.posted.elapsed_time(step.done) / 1000.0
            self.add(length, wait)
            added += 1
            # the end is the next step's start: only this step's own events go back
            self._pool.extend(e for e in step.events() if e is not step.end)
        return added

    @property
    def pending(self) -> int:
        """Steps recorded whose events the device has not yet completed."""
        return len(self._pending)

    def reset(self) -> None:
        super().reset()
        self._pending.clear()  # the old group's events may never complete: not reused
        self._end = self._posted_ev = self._done_ev = None
        self._spans = []


def step_timing_for(device: torch.device | None) -> StepTiming:
    """The step timing of a worker training on ``device``: CUDA events on a GPU
    (:class:`DeviceStepTiming`), the host's clock otherwise."""
    if device is not None and device.type == "cuda":
        return DeviceStepTiming(device)
    return StepTiming()
