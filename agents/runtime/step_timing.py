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
and by the step loop.  Its cost is two ``time.monotonic()`` calls per bucket
and one per step.  A model without DDP hooks (a sharded one) posts nothing:
its steps are not timed and the controller has nothing to compare.
"""

from __future__ import annotations

import threading
import time

__all__ = ["StepTiming"]


class StepTiming:
    """Running totals of this rank's compute and wait time over its timed steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # completions arrive on the backend's thread
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
        """A bucket's reduction completed (the backend's thread)."""
        now = time.monotonic()
        with self._lock:
            self._done = now

    def step_done(self) -> None:
        """A step ended: add its compute and wait time (the first after a reset only
        starts the clock: it holds the restore and the group's warm-up)."""
        now = time.monotonic()
        with self._lock:
            posted, done = self._posted, self._done
            self._posted = self._done = None
        last, self._last_step = self._last_step, now
        if last is None or posted is None or done is None or posted < last:
            return  # the first step of a generation, or a step without a gradient exchange
        step = now - last
        wait = min(max(done - posted, 0.0), step)
        self.compute_s += step - wait
        self.wait_s += wait
        self.steps += 1

    def reset(self) -> None:
        """A new generation: its first step is not timed (the totals go on)."""
        with self._lock:
            self._posted = self._done = None
        self._last_step = None
