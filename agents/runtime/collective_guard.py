"""Leave a collective that waits on a peer that will never answer.

A killed peer makes gloo's collectives raise at once, but a peer that hangs
(SIGSTOP, a stuck kernel) or is cut off by a partition does not, and NCCL
promises nothing either way.  Two things end such a wait here:

* **an operation timeout learnt from this job**: every collective may take
  ``multiple`` times the slowest recent step (``comm.op_timeout_multiple``),
  never less than ``comm.op_timeout_floor`` and never more than twice
  ``fault_tolerance.hang_timeout`` (the fixed timeout used before enough
  steps were seen).  It ends the wait on every backend.  Under a delayed
  sync a leader's wait for an outer sync's round, which spans many steps,
  and a boundary that waits for an outer result take ``multiple`` times the
  slowest recent outer sync instead (within the same floor and ceiling;
  the ceiling until this generation finished its second: its first may
  wait for a site catching up; plus ``sync.sync_timeout`` under a quorum).
* **an abort when the generation moves on**: once etcd shows a newer
  generation (the controller declared a peer dead) and the current step has
  not reached its boundary within a short grace, the generation's groups are
  aborted.  That ends an NCCL wait at once; gloo's abort does not interrupt a
  wait (nor close a connection), so there the timeout is what ends it.

A wait on a peer that has itself left the generation after a failure (the
local peer of a survivor, with several workers per node) is ended sooner: a
worker that leaves shuts down its groups' connections
(:func:`agents.runtime.process_group.hang_up`), and a closed connection ends a gloo
wait at once.

:class:`OpTimeout` is the pure rule; :class:`CollectiveGuard` applies it to a
generation's groups and watches for the abort.  What ended a step is named by
:meth:`CollectiveGuard.ended_by` and lands in the worker's telemetry (and so in
the recovery record).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

from agents.runtime.process_group import Groups, abort_groups, set_op_timeout

if TYPE_CHECKING:
    from orchestrator.spec.job import JobSpec

__all__ = [
    "WARMUP_ABORT_GRACE",
    "WARMUP_STEPS",
    "CollectiveGuard",
    "OpTimeout",
]

log = logging.getLogger("ringmaster.worker")

#: Steps of a generation before the timeout adapts: the first steps of every
#: generation include warm-up (a replacement's first forward, DDP's buckets).
WARMUP_STEPS = 3
#: How long a warm-up step may go on after a newer generation appeared.
WARMUP_ABORT_GRACE = 5.0
#: A new timeout is applied when it differs from the one in force by this fraction.
_REAPPLY = 0.25


class OpTimeout:
    """The operation timeout, from the durations of the recent steps (pure)."""

    def __init__(self, floor: float, multiple: float, ceiling: float, window: int = 64) -> None:
        self.floor = floor
        self.multiple = multiple
        self.ceiling = max(ceiling, floor)
        self._recent: deque[float] = deque(maxlen=window)
        self._seen = 0  # steps of the current generation
        self._outer: deque[float] = deque(maxlen=window)
        self._outer_seen = 0  # outer syncs of the current generation

    @classmethod
    def of_job(cls, spec: JobSpec) -> OpTimeout:
        """The job file's: ``comm.op_timeout_floor`` and ``op_timeout_multiple``, and
        twice ``fault_tolerance.hang_timeout`` as the ceiling."""
        comm = spec.comm
        return cls(
            floor=comm.op_timeout_floor.total_seconds(),
            multiple=comm.op_timeout_multiple,
            ceiling=2 * spec.fault_tolerance.hang_timeout.total_seconds(),
        )

    def new_generation(self) -> None:
        """A generation starts: the ceiling applies again until it has warmed up."""
        self._seen = 0
        self._outer_seen = 0

    def observe_outer(self, sync_seconds: float) -> None:
        """An outer sync took ``sync_seconds`` from its start to its result's use."""
        if self._outer_seen >= 1:  # a generation's first may wait for a site catching up
            self._outer.append(sync_seconds)
        self._outer_seen += 1

    def between_sites(self) -> float:
        """Seconds a collective between sites (or a boundary that waits for one) may take."""
        if self._outer_seen < 2:  # the second sync of this generation was recorded
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.multiple * max(self._outer)))

    def observe(self, step_seconds: float) -> None:
        if self._seen >= WARMUP_STEPS:  # warm-up steps say nothing of steady state
            self._recent.append(step_seconds)
        self._seen += 1

    @property
    def slowest_recent(self) -> float:
        return max(self._recent, default=0.0)

    def current(self) -> float:
        """Seconds a collective may take now."""
        if self._seen < WARMUP_STEPS or not self._recent:
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.multiple * self.slowest_recent))

    def abort_grace(self) -> float:
        """How long a step may go on after a newer generation appeared: long enough
        for a planned change's step to reach its boundary on its own."""
        if self._seen < WARMUP_STEPS:  # warm-up steps are slow: their length is unknown
            return min(self.ceiling, max(WARMUP_ABORT_GRACE, 2 * self.slowest_recent))
        return min(self.current(), max(0.5, 2 * self.slowest_recent))


class CollectiveGuard:
    """Applies :class:`OpTimeout` to each generation's groups; aborts them when
    ``latest_generation()`` shows the generation moved on (see the module docstring)."""

    def __init__(
        self,
        timeout: OpTimeout,
        latest_generation: Callable[[], int],
        poll: float = 0.05,
    ) -> None:
        self.timeout = timeout
        self._latest = latest_generation
        self._poll = poll
        self._lock = threading.Lock()
        self._groups: Groups | None = None
        self._generation = 0
        self._applied = 0.0
        self._relaxed = 0
        self._newer_seen_at: float | None = None
        self._aborted: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="collective-guard", daemon=True)
        self._thread.start()

    # -- the training thread's calls ---------------------------------------------------

    def attach(self, groups: Groups, generation: int) -> None:
        """Guard ``generation``'s groups from now on (after its state sync)."""
        with self._lock:
            self._groups, self._generation = groups, generation
            self._newer_seen_at = None
            self.timeout.new_generation()
            self._apply(self.timeout.current(), force=True)

    def detach(self) -> None:
        """Stop guarding (before the groups are torn down)."""
        with self._lock:
            self._groups = None

    def step_ended(self, seconds: float) -> None:
        """A step and its boundary took ``seconds``; adapt the timeout."""
        self.timeout.observe(seconds)
        with self._lock:
            if self._groups is not None and not self._relaxed:
                self._apply(self.timeout.current())

    def outer_synced(self, seconds: float) -> None:
        """An outer sync took ``seconds``; adapt the timeout between sites."""
        self.timeout.observe_outer(seconds)
        with self._lock:
            if self._groups is not None and not self._relaxed:
                self._apply(self.timeout.current(), force=True)

    @contextmanager
    def relaxed(self, seconds: float | None = None) -> Iterator[None]:
        """Collectives inside get ``seconds`` (None: the ceiling, as a durable save's
        do), not the learnt timeout."""
        with self._lock:
            self._relaxed += 1
            if self._groups is not None:
                self._apply(self.timeout.ceiling if seconds is None else seconds, force=True)
        try:
            yield
        finally:
            with self._lock:
                self._relaxed -= 1
                if self._groups is not None and not self._relaxed:
                    self._apply(self.timeout.current(), force=True)

    def between_sites(self, grace_s: float = 0.0) -> AbstractContextManager[None]:
        """A boundary that waits for an outer result (a site's ranks wait in its
        broadcast while their leader waits for the other sites): every group gets
        the timeout between sites where it is the longer, plus ``grace_s`` (how long
        a round under a quorum waits for the sites beyond it)."""
        between = self.timeout.between_sites() + grace_s
        return self.relaxed(max(self.timeout.current(), between))

    def ended_by(self, error: BaseException) -> str:
        """What ended the failed step: ``timeout``, ``abort`` or ``error`` (it raised).

        Gloo ignores an abort while it waits, so a timed-out wait is a timeout
        even where an abort came first.
        """
        text = str(error).lower()
        if "timed out" in text or "timeout" in text:
            return "timeout"
        if self._aborted is not None and self._aborted == self._generation:
            return "abort"
        return "error"

    def close(self) -> None:
        self._stop.set()
        self.detach()

    # -- internals ---------------------------------------------------------------------

    def _apply(self, seconds: float, force: bool = False) -> None:
        assert self._groups is not None
        if not force and abs(seconds - self._applied) <= _REAPPLY * self._applied:
            return
        try:
            set_op_timeout(self._groups, timedelta(seconds=seconds))
            self._applied = seconds
        except (RuntimeError, AttributeError) as e:  # a torch without per-group timeouts
            log.debug("operation timeout not applied: %s", e)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            with self._lock:
                if self._groups is None or self._relaxed or self._aborted == self._generation:
                    continue
                if self._latest() <= self._generation:
                    self._newer_seen_at = None
                    continue
                now = time.monotonic()
                if self._newer_seen_at is None:
                    self._newer_seen_at = now
                    continue
                if now - self._newer_seen_at < self.timeout.abort_grace():
                    continue
                log.warning(
                    "generation %d moved on and the step has not ended for %.2fs: "
                    "aborting its process groups",
                    self._generation,
                    now - self._newer_seen_at,
                )
                abort_groups(self._groups)
                self._aborted = self._generation
