"""Timed, recurring etcd calls on a few threads: how a simulated fleet keeps its rates.

A real node runs one heartbeat thread per worker and one keep-alive thread
per lease; a thousand simulated nodes cannot.  :class:`Lanes` runs every
timed job of a fleet on a fixed number of threads instead.  Each lane owns a
heap of jobs ordered by when they are due; a job's :meth:`Job.run` does its
etcd call and returns when it is due next (None: it is done).  How late each
job starts against its due time is recorded: when the lanes cannot keep up,
the lateness grows, and the rates the benchmark reports are below what the
fleet was meant to produce, which it then says.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from typing import Protocol

log = logging.getLogger("ringmaster.bench.lanes")

#: Lateness samples kept per lane (the newest).
KEEP_SAMPLES = 20_000
#: When a job raised, it runs again this much later.
RETRY_S = 1.0


class Job(Protocol):
    def run(self, now: float) -> float | None:
        """Do the job at monotonic time ``now``; return when it is due next, or None."""


class Lane:
    """One thread running the jobs of its heap when they are due."""

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[float, int, Job]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self.lateness: deque[float] = deque(maxlen=KEEP_SAMPLES)
        #: how long each run took (mostly the etcd call's round trip)
        self.durations: deque[float] = deque(maxlen=KEEP_SAMPLES)
        self.runs = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def push(self, due: float, job: Job) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), job))
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    if self._heap:
                        wait = self._heap[0][0] - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                if self._stopped:
                    return
                due, _, job = heapq.heappop(self._heap)
            now = time.monotonic()
            self.lateness.append(now - due)
            try:
                after = job.run(now)
            except Exception as e:  # counted and tried again: a job keeps its rhythm
                self.errors += 1
                log.warning("%r failed (again in %gs): %s", job, RETRY_S, e)
                after = now + RETRY_S
            self.durations.append(time.monotonic() - now)
            self.runs += 1
            if after is not None:
                self.push(after, job)

    def stop(self, wait: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=wait)


class Lanes:
    """``count`` lanes; jobs are spread over them round-robin."""

    def __init__(self, count: int) -> None:
        self.lanes = [Lane(f"lane-{i}") for i in range(count)]
        self._next = itertools.count()

    def add(self, due: float, job: Job, lane: int | None = None) -> int:
        """Schedule ``job`` at ``due``; returns its lane (to keep a node's jobs together)."""
        index = next(self._next) % len(self.lanes) if lane is None else lane
        self.lanes[index].push(due, job)
        return index

    def samples(self, reset: bool = False) -> tuple[list[float], list[float]]:
        """Every kept sample of lateness and of run time (seconds), optionally clearing them."""
        late: list[float] = []
        took: list[float] = []
        for lane in self.lanes:
            late.extend(lane.lateness)
            took.extend(lane.durations)
            if reset:
                lane.lateness.clear()
                lane.durations.clear()
        return late, took

    @property
    def errors(self) -> int:
        return sum(lane.errors for lane in self.lanes)

    def stop(self, wait: float = 5.0) -> None:
        """Stop every lane; waits up to ``wait`` in all for calls in flight to end."""
        for lane in self.lanes:
            lane.stop(wait=0)
        deadline = time.monotonic() + wait
        for lane in self.lanes:
            lane.stop(wait=max(0.0, deadline - time.monotonic()))
