"""How long each step of this rank computes, and how long it waits for its peers.

Runs inside the training process.  A synchronous job runs at the pace of its
slowest rank: the others finish their backward pass first and then wait in the
gradient all-reduce until the slow rank's buckets arrive.  So, per step, the
time from this rank posting its *last* gradient bucket to that bucket's
reduction completing is what it spent waiting for others (plus the last
bucket's time on the wire); the rest of the step (forward, backward, the
optimizer, loading data) is its own compute.  A slow rank shows a long
compute time and almost no wait; its peers the reverse.

:class:`StepTiming` keeps running totals (the controller takes differences
between two heartbeats: :mod:`orchestrator.controller.stragglers`); it is fed
by the DDP comm hooks (:class:`~agents.runtime.failures.CollectiveFailures`)
and by the step loop.  Its cost is one ``time.monotonic()`` call and one
attribute store per gradient bucket posted and per bucket completed, and one
call and a few additions per step: under 0.1 µs a bucket and about 0.2 µs a
step (``benchmarks/step_timing_cost.py`` measures it), against the 0.5 % of a
50 ms step (250 µs) it may take.  Nothing is written anywhere per step: the
totals travel in the heartbeat the worker sends anyway.  A model without DDP
hooks (a sharded one) posts nothing: its steps are not timed and the
controller has nothing to compare.

No lock: a completion is stored on the backend's thread, but DDP's backward
pass returns only once every bucket's future (the hook's callback included)
has completed, so the step loop reads a step's last completion after it was
stored; a single attribute store is atomic in CPython.
"""

from __future__ import annotations

import time

__all__ = ["StepTiming"]


class StepTiming:
    """Running totals of this rank's compute and wait time over its timed steps."""

    __slots__ = ("_done", "_last_step", "_posted", "compute_s", "steps", "wait_s")

    def __init__(self) -> None:
        self._posted: float | None = None
        self._done: float | None = None
        self._last_step: float | None = None
        #: seconds the timed steps spent outside the final gradient wait
        self.compute_s = 0.0
        #: seconds they spent waiting for the last gradient bucket's reduction
        self.wait_s = 0.0
        #: steps timed (steps with a gradient exchange, after the first of a generation)
        self.steps = 0

    def posted(self) -> None:
        """A gradient bucket was handed to its collective (the last one counts)."""
        self._posted = time.monotonic()

    def completed(self) -> None:
        """A bucket's reduction completed (on the backend's thread; the last one counts)."""
        self._done = time.monotonic()

    def step_done(self) -> None:
        """A step ended: add its compute and wait time (the first after a reset only
        starts the clock: it holds the restore and the group's warm-up)."""
        now = time.monotonic()
        posted, done, last = self._posted, self._done, self._last_step
        self._posted = self._done = None
        self._last_step = now
        if last is None or posted is None or done is None or posted < last:
            return  # the first step of a generation, or a step without a gradient exchange
        step = now - last
        wait = done - posted
        if wait < 0.0:
            wait = 0.0
        elif wait > step:
            wait = step
        self.compute_s += step - wait
        self.wait_s += wait
        self.steps += 1

    def reset(self) -> None:
        """A new generation: its first step is not timed (the totals go on)."""
        self._posted = self._done = None
        self._last_step = None
