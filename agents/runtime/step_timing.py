"""How long each step of this rank computes, and how long it waits for its peers.

Runs inside the training process.  A synchronous job runs at the pace of its
slowest rank: the others finish their share of the step first and then wait
in a collective until the slow rank's contribution arrives.  What a rank
spent waiting is read where its collectives block it; the rest of the step
(forward, backward, the optimizer, loading data) is its own compute.  A slow
rank shows a long compute time and almost no wait; its peers the reverse.

Two kinds of job feed it:

* **DDP** (the comm hooks of :class:`~agents.runtime.failures.CollectiveFailures`):
  the gradient buckets' all-reduces run while the backward pass goes on, and
  the step blocks only on the last one.  The time from this rank posting its
  *last* bucket to that bucket's reduction completing is its wait (plus the
  last bucket's time on the wire): :meth:`StepTiming.posted`,
  :meth:`StepTiming.completed`;
* **sharded models** (FSDP2, HSDP, meshes: :mod:`agents.state.sharded_timing`):
  their all-gathers, reduce-scatters and replica all-reduces block the step
  where they are called, so each one's duration counts as wait:
  :meth:`StepTiming.collective_started`, :meth:`StepTiming.collective_ended`.

:class:`StepTiming` reads the host's clock: right for gloo, where a collective
returns when it is done.  On a GPU the host runs ahead of the device and a
collective returns when it is queued; :mod:`agents.runtime.device_timing` reads
the same moments from CUDA events instead
(:func:`~agents.runtime.device_timing.step_timing_for` picks).  Either keeps
running totals (the controller takes differences between two heartbeats:
:mod:`orchestrator.controller.stragglers`).

Its cost on the host clock is one ``time.monotonic()`` call and one attribute
store per gradient bucket posted and per bucket completed (two calls and an
addition per sharded collective), and one call and a few additions per step:
under 0.1 µs a bucket and about 0.2 µs a step (``benchmarks/step_timing_cost.py``
measures it), against the 0.5 % of a 50 ms step (250 µs) it may take.  Nothing
is written anywhere per step: the totals travel in the heartbeat the worker
sends anyway.  A model whose collectives pass through neither hook (a script's
own ``dist`` calls) posts nothing: its steps are not timed and the controller
has nothing to compare.

No lock: a completion is stored on the backend's thread, but DDP's backward
pass returns only once every bucket's future (the hook's callback included)
has completed, and a sharded model's collectives return before its step does,
so the step loop reads a step's figures after they were stored; a single
attribute store is atomic in CPython.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["StepTiming"]


class StepTiming:
    """Running totals of this rank's compute and wait time over its timed steps."""

    __slots__ = (
        "_blocked",
        "_collectives",
        "_done",
        "_last_step",
        "_posted",
        "compute_s",
        "steps",
        "wait_s",
    )

    def __init__(self) -> None:
        self._posted: float | None = None
        self._done: float | None = None
        self._last_step: float | None = None
        #: seconds this step's sharded collectives blocked it, and how many there were
        self._blocked = 0.0
        self._collectives = 0
        #: seconds the timed steps spent outside their waits for peers
        self.compute_s = 0.0
        #: seconds they spent waiting for the last gradient bucket or in sharded collectives
        self.wait_s = 0.0
        #: steps timed (steps with a collective, after the first of a generation)
        self.steps = 0

    def posted(self) -> None:
        """A gradient bucket was handed to its collective (the last one counts)."""
        self._posted = time.monotonic()

    def completed(self) -> None:
        """A bucket's reduction completed (on the backend's thread; the last one counts)."""
        self._done = time.monotonic()

    def collective_started(self) -> Any:
        """A sharded model's collective starts; pass the result to :meth:`collective_ended`."""
        return time.monotonic()

    def collective_ended(self, started: Any) -> None:
        """The collective begun at ``started`` returned: all of it was a wait."""
        self._blocked += time.monotonic() - started
        self._collectives += 1

    def step_done(self) -> None:
        """A step ended: add its compute and wait time (the first after a reset only
        starts the clock: it holds the restore and the group's warm-up)."""
        now = time.monotonic()
        posted, done, last = self._posted, self._done, self._last_step
        blocked, collectives = self._blocked, self._collectives
        self._posted = self._done = None
        self._blocked, self._collectives = 0.0, 0
        self._last_step = now
        if last is None:
            return  # the first step of a generation
        wait = blocked
        if posted is not None and done is not None and posted >= last:
            wait += done - posted
        elif not collectives:
            return  # a step without a collective (or only a stale bucket of the last one)
        self.add(now - last, wait)

    def add(self, step: float, wait: float) -> None:
        """Count one step of ``step`` seconds, ``wait`` of them waiting (clamped to the step)."""
        wait = min(max(wait, 0.0), step)
        self.compute_s += step - wait
        self.wait_s += wait
        self.steps += 1

    def reset(self) -> None:
        """A new generation: its first step is not timed (the totals go on)."""
        self._posted = self._done = None
        self._blocked, self._collectives = 0.0, 0
        self._last_step = None
