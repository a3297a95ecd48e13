"""The straggler benchmark's slow node: held at its nominal factor, measured as it runs.

A slowdown applied from outside is not the slowdown a node gets when every
node runs on the same few cores: CPU work added to one node's steps is taken
from its peers while they compute, a process stopped part of the time gives
its core to its peers, and the machine's other work takes its share of all of
them, more at one moment than at the next.  So the benchmark does not trust
the knob.  It measures what the node had, as the controller measures it (each
member's slowest worker's compute time per step over its heartbeats:
:func:`orchestrator.controller.stragglers.node_timings`), and a
:class:`HeldSlowdown` adjusts what it applies until the node's compute time
per step over the median of its peers' is the nominal factor, and keeps it
there as the load moves.

Measured: the workers' heartbeats are read as they come; once a heartbeat
interval has passed and every member's worker has beaten again, their totals
are kept (a snapshot), and a
window closes over the last snapshots that hold :data:`MIN_STEPS` steps of
every worker (one heartbeat interval, or more when the steps are long, as the
controller reaches back).  :meth:`HeldSlowdown.factor_between` gives the
factor over all the steps between two moments (the onset and the call: the
row's measured factor).

The control: what is applied is a factor ``k`` (``apply(k)``: the stretch of
each step, or the share of time stopped, of the row's ``--slowdown``); the
node's excess over its peers is taken to be proportional to what is applied,
``m - 1 = g (k - 1)``.  ``k`` changes only on a window measured entirely under
the ``k`` applied now (a long window is not read twice): the gain ``g`` is
estimated over the last :data:`RECENT` such windows together (one window of
a loaded machine is noisy) and the next ``k`` is ``1 + (factor - 1) / g``, its
excess changed by at most a factor of :data:`CHANGE` at once.  It starts at
``k = factor``, or where the row's last run ended.  ``reached_at``: the end
of the first window measured entirely after the onset at 95 % of the factor
or more.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.controller.stragglers import MIN_STEPS, NodeTiming, node_timings
from orchestrator.controller.world import read_progress
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys
from orchestrator.state.records import Plan, ProgressRecord, Telemetry

__all__ = ["HeldSlowdown", "Window", "measured_factor", "next_applied", "per_step"]

#: a window counts as at the factor from this share of it up
REACHED = 0.95
#: the gain is estimated over the last windows that changed ``k``, this many
RECENT = 3
#: the gain's estimate stays within these bounds (a window of noise cannot send ``k``
#: far off), ``k - 1`` changes by at most a factor of ``CHANGE`` a window, and ``k``
#: stays within ``1 + MAX_EXCESS * (factor - 1)``
GAIN = (0.25, 4.0)
CHANGE = 1.5
MAX_EXCESS = 6.0
#: snapshots kept (a run's healthy reference and slowdown fit in, at a snapshot every
#: heartbeat interval)
SNAPSHOTS = 2000

#: (wall-clock time, every worker's totals then)
Snapshot = tuple[float, dict[str, Telemetry]]


@dataclass(frozen=True)
class Window:
    """One window of the slow node's timing against its peers'.

    Attributes:
        at: wall-clock time the window closed.
        factor: the slow node's compute time per step over the median of its peers'.
        applied: the factor applied when the window closed.
        slow: the slow node's timing; peers: each peer's.
        start: wall-clock time the window opened.
    """

    at: float
    factor: float
    applied: float
    slow: NodeTiming
    peers: dict[str, NodeTiming]
    start: float = 0.0


def per_step(windows: list[Window]) -> tuple[float, float] | None:
    """The slow node's compute time per step and the median of its peers', over
    ``windows`` together (each node's compute time summed over its steps)."""
    slow_steps = sum(w.slow.steps for w in windows)
    compute: dict[str, float] = {}
    steps: dict[str, int] = {}
    for w in windows:
        for name, t in w.peers.items():
            compute[name] = compute.get(name, 0.0) + t.compute_s * t.steps
            steps[name] = steps.get(name, 0) + t.steps
    peers = [compute[name] / steps[name] for name in compute if steps[name]]
    if not slow_steps or not peers:
        return None
    slow = sum(w.slow.compute_s * w.slow.steps for w in windows) / slow_steps
    return slow, statistics.median(peers)


def measured_factor(windows: list[Window]) -> float | None:
    """The slow node's compute per step over its peers' median, over ``windows``
    together (:func:`per_step`)."""
    both = per_step(windows)
    return both[0] / both[1] if both is not None and both[1] > 0 else None


def next_applied(recent: list[Window], factor: float, applied: float) -> float:
    """What to apply next for the measured factor to be ``factor``, from the ``recent``
    windows (``applied``: what is applied now; see the module docstring)."""
    measured = measured_factor(recent)
    steps = sum(w.slow.steps for w in recent)
    mean = sum(w.applied * w.slow.steps for w in recent) / max(steps, 1)
    if measured is None or mean <= 1.0 or applied <= 1.0:
        return applied
    gain = min(max((measured - 1.0) / (mean - 1.0), GAIN[0]), GAIN[1])
    excess = applied - 1.0
    wanted = min(max((factor - 1.0) / gain, excess / CHANGE), excess * CHANGE)
    return 1.0 + min(wanted, MAX_EXCESS * (factor - 1.0))


@dataclass
class HeldSlowdown:
    """Holds ``node`` of ``job`` at ``factor`` times its peers' compute per step.

    Call :meth:`watch` when the healthy reference starts (windows are measured from
    there, nothing applied), :meth:`start` at the onset, :meth:`poll` often (it
    reads the workers' heartbeats, see the module docstring), and :meth:`stop` at
    the end.  ``calibrate=False`` applies ``factor`` as it is and only measures.

    Args:
        client: the job's etcd.
        job: the job's name.
        node: the slow node (a member of the plan watched).
        factor: the nominal factor.
        apply: sets what is applied (1.0: nothing).
        calibrate: adjust what is applied to the measured factor.
        interval: seconds between two snapshots at least (the job's heartbeat
            interval: the controller's windows).
        initial: what to apply at the onset (None: ``factor``; a row's later runs
            start where its last run ended).
    """

    client: EtcdClient
    job: str
    node: str
    factor: float
    apply: Callable[[float], None]
    calibrate: bool = True
    interval: float = 2.0
    initial: float | None = None
    windows: list[Window] = field(default_factory=list)
    #: the factor applied now (until :meth:`stop`: the last applied)
    applied: float = 1.0
    #: wall-clock time of :meth:`start`
    onset: float | None = None
    #: wall-clock time of the first window after the onset at :data:`REACHED` of the
    #: factor or more
    reached_at: float | None = None
    _plan: Plan | None = None
    #: every worker's totals when each had beaten again, oldest first
    _snapshots: list[Snapshot] = field(default_factory=list)
    #: when ``applied`` last changed, and the windows that changed it
    _changed_at: float = 0.0
    _used: list[Window] = field(default_factory=list)

    def watch(self, plan: Plan) -> None:
        """Measure windows from now on (of ``plan``'s members; nothing applied yet)."""
        if self.node not in {m.node for m in plan.members}:
            raise ValueError(
                f"{self.node} is not a member of {self.job}'s generation "
                f"{plan.generation}: the slow node must be one"
            )
        self._plan = plan
        self._snapshot(read_progress(self.client, self.job))

    def start(self) -> None:
        """The onset: apply ``initial`` or ``factor`` (after :meth:`watch`)."""
        if self._plan is None:
            raise RuntimeError("HeldSlowdown.start before watch: nothing is measured")
        self.onset = time.time()
        self._set(self.initial if self.initial is not None and self.calibrate else self.factor)

    def stop(self) -> None:
        """The end: nothing applied any more (:attr:`applied` keeps what was)."""
        self.apply(1.0)

    def poll(self) -> Window | None:
        """Take a snapshot once every member's worker has beaten again and close a
        window over it; adjust what is applied.  Returns the window closed, if any."""
        if self._plan is None or not self._snapshots:
            return None
        if time.time() - self._snapshots[-1][0] < self.interval:
            return None
        progress = read_progress(self.client, self.job)
        last = self._snapshots[-1][1]
        workers = self._workers()
        if any(w not in progress or w not in last for w in workers):
            return None
        if any(progress[w].telemetry == last[w] for w in workers):
            return None  # not every worker has beaten since the last snapshot
        self._snapshot(progress)
        window = self._window()
        if window is None:
            return None
        self.windows.append(window)
        if self.onset is None or window.start < self.onset:
            return window  # the healthy reference, or the onset inside it
        if self.reached_at is None and window.factor >= REACHED * self.factor:
            self.reached_at = window.at
        if self.calibrate and window.start >= self._changed_at:
            self._used.append(window)
            self._set(next_applied(self._used[-RECENT:], self.factor, self.applied))
        return window

    def factor_between(self, start: float, end: float) -> tuple[float, float] | None:
        """The slow node's compute time per step and its peers' median, over every step
        between the first snapshot at or after ``start`` and the last at or before
        ``end`` (wall clock); None without two such snapshots or enough steps."""
        inside = [snapshot for snapshot in self._snapshots if start <= snapshot[0] <= end]
        if len(inside) < 2:
            return None
        window = self._timed(inside[0], inside[-1])
        if window is None:
            return None
        return window.slow.compute_s, statistics.median(t.compute_s for t in window.peers.values())

    def _workers(self) -> list[str]:
        assert self._plan is not None
        return [w for m in self._plan.members for w in keys.worker_ids(m.node, m.nproc)]

    def _snapshot(self, progress: dict[str, ProgressRecord]) -> None:
        now = {w: p.telemetry for w, p in progress.items()}
        self._snapshots = [*self._snapshots, (time.time(), now)][-SNAPSHOTS:]

    def _window(self) -> Window | None:
        """The window over the latest snapshots that hold MIN_STEPS of every worker."""
        end = self._snapshots[-1]
        for start in reversed(self._snapshots[:-1]):
            past, now = start[1], end[1]
            if all(
                w in past
                and past[w].generation == now[w].generation
                and now[w].timed_steps - past[w].timed_steps >= MIN_STEPS
                for w in self._workers()
            ):
                return self._timed(start, end)
        return None

    def _timed(self, start: Snapshot, end: Snapshot) -> Window | None:
        """The window from snapshot ``start`` to ``end``, if it is to be judged."""
        assert self._plan is not None
        progress = {
            w: ProgressRecord(
                step=0,
                generation=t.generation,
                rank=0,
                world_size=0,
                pid=0,
                beat=end[0],
                step_time=end[0],
                telemetry=t,
            )
            for w, t in end[1].items()
        }
        timings = node_timings(start[1], progress, self._plan)
        if not timings or self.node not in timings:
            return None  # a save, a new generation: not to be judged
        peers = {n: t for n, t in timings.items() if n != self.node}
        median = statistics.median(t.compute_s for t in peers.values()) if peers else 0.0
        if median <= 0:
            return None
        mine = timings[self.node]
        return Window(end[0], mine.compute_s / median, self.applied, mine, peers, start[0])

    def _set(self, applied: float) -> None:
        self.applied = round(applied, 3)
        self._changed_at = time.time()
        self.apply(self.applied)

    def between(self, start: float, end: float) -> list[Window]:
        """The windows that closed between ``start`` and ``end`` (wall clock)."""
        return [w for w in self.windows if start < w.at <= end]
