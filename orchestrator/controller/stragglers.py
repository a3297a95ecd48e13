"""Stragglers: a node that keeps stepping slower than its peers, told from their timings.

Pure (no I/O): the controller feeds it the workers' heartbeats each tick; it
closes a window every heartbeat interval and says which nodes it calls slow
(:mod:`orchestrator.controller.straggler_swaps` turns that into events, the
job's status and, with ``action: swap``, a spare in the slow node's place).
Each worker's heartbeat carries running totals of the time its steps spent
computing and waiting for their peers in the final gradient reduction
(:mod:`agents.runtime.step_timing`); the difference of two heartbeats is a
window.  Per node the slowest of its workers counts (a node
is as slow as its slowest rank).

A node is a straggler when its compute time per step is at least
``threshold`` times the median of the other nodes' for ``windows`` windows in
a row (``fault_tolerance.stragglers``).  What slows every rank alike is not
a straggler: a save (a window in which any worker's checkpoint timings
changed is not judged), the first steps of a generation (a worker's first
step after its group formed is not timed, and a window whose worker changed
generation is not judged), a window with too few steps.  A node called a
straggler is called again only after it has been back under the threshold
for ``windows`` windows (it is then reported as recovered).

A window closes every heartbeat interval.  A worker that timed fewer than
:data:`MIN_STEPS` steps in it (its steps take longer than a third of the
interval: a long step, or a node slowed that far) is judged over as many
intervals back as its last :data:`MIN_STEPS` steps took (up to
:data:`REACH_BACK`), so a job is judged every interval whatever its step
time; what a slow node costs the job is counted over the steps new in the
window only (:attr:`NodeTiming.new_steps`), never twice.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from orchestrator.controller.slow_links import LinkProbeResult, LinkWatch
from orchestrator.spec.job import StragglerSpec
from orchestrator.state import keys
from orchestrator.state.records import Plan, ProgressRecord, Telemetry

__all__ = [
    "MIN_STEPS",
    "REACH_BACK",
    "NodeTiming",
    "Straggler",
    "StragglerWatch",
    "node_timings",
    "window_starts",
]

#: Steps a worker must have timed in a window for the window to say anything of it.
MIN_STEPS = 3
#: Heartbeat intervals a window reaches back at most for a worker's :data:`MIN_STEPS`.
REACH_BACK = 10


@dataclass(frozen=True)
class NodeTiming:
    """One node's window: its slowest worker's mean compute and wait time per step."""

    compute_s: float
    wait_s: float
    steps: int
    #: steps new since the previous window (None: all of ``steps``; fewer when the
    #: window reached back for :data:`MIN_STEPS`)
    new: int | None = None

    @property
    def new_steps(self) -> int:
        return self.steps if self.new is None else self.new


@dataclass(frozen=True)
class Straggler:
    """A node called slow, and the evidence.

    Attributes:
        node: the node.
        slowdown: its compute time per step over the median of its peers'.
        compute_s: its compute time per step in the last window.
        peers_s: the median of its peers' compute time per step.
        wait_s: how long it waited for others per step (near 0 when it is the slow one).
        peers_wait_s: how long its peers waited per step (for it).
        windows: windows in a row it stayed above the threshold.
        cause: ``compute``, or ``link`` (:mod:`orchestrator.controller.slow_links`).
        evidence: a link straggler's evidence, in words.
    """

    node: str
    slowdown: float
    compute_s: float
    peers_s: float
    wait_s: float
    peers_wait_s: float
    windows: int
    cause: str = "compute"
    evidence: str = ""

    def describe(self) -> str:
        if self.evidence:
            return self.evidence
        return (
            f"{self.node} computes {self.slowdown:.2f}x as long per step as its peers "
            f"({self.compute_s * 1000:.1f} ms against a median of {self.peers_s * 1000:.1f} "
            f"ms) for {self.windows} windows in a row; it waits {self.wait_s * 1000:.1f} ms "
            f"per step for the others, they wait {self.peers_wait_s * 1000:.1f} ms for it"
        )


def node_timings(
    before: dict[str, Telemetry],
    progress: dict[str, ProgressRecord],
    plan: Plan,
    latest: dict[str, Telemetry] | None = None,
) -> dict[str, NodeTiming] | None:
    """Each member's timing over the window from ``before`` to ``progress``.

    Args:
        latest: the previous window's end, where ``before`` reaches further back:
            the steps since it are the window's new ones (:attr:`NodeTiming.new`).

    Returns:
        The nodes with enough timed steps (:data:`MIN_STEPS`), or None when the
        window is not to be judged (a save, or a worker changed generation).
    """
    out: dict[str, NodeTiming] = {}
    for m in plan.members:
        slowest: NodeTiming | None = None
        for w in keys.worker_ids(m.node, m.nproc):
            p, old = progress.get(w), before.get(w)
            if p is None or old is None:
                continue
            now = p.telemetry
            if now.generation != old.generation or now.timed_steps < old.timed_steps:
                return None  # a new generation, or a new process: its totals start over
            saved = (now.checkpoint_blocking_s, now.checkpoint_upload_s)
            if saved != (old.checkpoint_blocking_s, old.checkpoint_upload_s):
                return None  # a save in the window slows its ranks alike
            steps = now.timed_steps - old.timed_steps
            if steps < MIN_STEPS:
                continue
            last = latest.get(w) if latest is not None else None
            new = None
            if last is not None and last.generation == now.generation:
                new = max(now.timed_steps - last.timed_steps, 0)
            timing = NodeTiming(
                (now.compute_s - old.compute_s) / steps,
                (now.wait_s - old.wait_s) / steps,
                steps,
                new,
            )
            if slowest is None or timing.compute_s > slowest.compute_s:
                slowest = timing
        if slowest is not None:
            out[m.node] = slowest
    return out


def window_starts(
    history: list[dict[str, Telemetry]], progress: dict[str, ProgressRecord]
) -> dict[str, Telemetry]:
    """Where each worker's window starts: the latest of the past windows' ends
    (``history``, oldest first) it has timed :data:`MIN_STEPS` steps since, in its
    generation and with no save between; the last window's end when none has."""
    out = dict(history[-1])
    for w, p in progress.items():
        now = p.telemetry
        saved = (now.checkpoint_blocking_s, now.checkpoint_upload_s)
        for past in reversed(history):
            old = past.get(w)
            if old is None or old.generation != now.generation or now.timed_steps < old.timed_steps:
                break
            if (old.checkpoint_blocking_s, old.checkpoint_upload_s) != saved:
                break  # a save between: not reached back over
            if now.timed_steps - old.timed_steps >= MIN_STEPS:
                out[w] = old
                break
    return out


@dataclass
class StragglerWatch:
    """Which nodes are stragglers now, window after window (see the module docstring).

    Args:
        spec: ``fault_tolerance.stragglers``.
    """

    spec: StragglerSpec
    #: seconds between two windows (the heartbeat interval)
    window_s: float = 2.0
    #: nodes called stragglers, with the evidence of when they were called
    flagged: dict[str, Straggler] = field(default_factory=dict)
    #: windows in a row each node was above the threshold (below, for a flagged one)
    _streak: dict[str, int] = field(default_factory=dict)
    #: each node's latest slowdown and timing (for the metrics)
    slowdowns: dict[str, float] = field(default_factory=dict)
    timings: dict[str, NodeTiming] = field(default_factory=dict)
    #: nodes swapped out for being slow → their agent's registration time (None until
    #: read): not spares again until that agent restarts or an operator releases them
    quarantined: dict[str, float | None] = field(default_factory=dict)
    #: stragglers already told to keep their slot (said once each)
    kept: set[str] = field(default_factory=set)
    #: seconds each node has cost the job since its first slow window (see the module
    #: docstring); a node not above the threshold (and not called) has none
    lost: dict[str, float] = field(default_factory=dict)
    #: slow links (:mod:`orchestrator.controller.slow_links`), judged with each window
    links: LinkWatch = field(init=False)
    #: the last window asks the agents to measure their links
    probe_wanted: bool = False
    #: the ends of the last :data:`REACH_BACK` windows (each worker's totals), oldest first
    _history: list[dict[str, Telemetry]] = field(default_factory=list)
    _window_at: float | None = None
    _generation: int = 0

    def __post_init__(self) -> None:
        self.links = LinkWatch(self.spec)

    def tick(
        self, plan: Plan, progress: dict[str, ProgressRecord], mono: float
    ) -> tuple[list[Straggler], list[str]]:
        """Close a window when one is due (every :attr:`window_s` of ``mono``) and judge
        it: the nodes newly called stragglers and those cleared (see :meth:`judge`)."""
        if plan.generation != self._generation:  # a new group: its timings start over
            self._generation, self._history, self._window_at = plan.generation, [], None
            self.forget(set(self.slowdowns) - {m.node for m in plan.members})
        if self._window_at is not None and mono - self._window_at < self.window_s:
            return [], []
        history = self._history
        self._history = [*history, {w: p.telemetry for w, p in progress.items()}][-REACH_BACK:]
        self._window_at = mono
        timings = None
        if history:
            before = window_starts(history, progress)
            timings = node_timings(before, progress, plan, latest=history[-1])
        if not timings:
            return [], []
        self.timings = timings
        called, cleared = self.judge(timings)
        per_step = {n: (t.compute_s, t.wait_s, t.new_steps) for n, t in timings.items()}
        self.probe_wanted, cost, ended = self.links.window(plan.generation, per_step, mono)
        slow_link = next((n for n, s in self.flagged.items() if s.cause == "link"), None)
        if slow_link is not None and ended:
            del self.flagged[slow_link]
            self.kept.discard(slow_link)
            self.lost.pop(slow_link, None)
            cleared.append(slow_link)
        elif slow_link is not None:
            self.lost[slow_link] = self.lost.get(slow_link, 0.0) + cost
        return called, cleared

    def take_probe(self, result: LinkProbeResult, members: set[str]) -> list[Straggler]:
        """A link probe's result: the node called for its slow link, if any (a member)."""
        call = self.links.verdict(result)
        if call is None:
            return []
        if call.node not in members:
            self.links.forget({call.node})  # a spare's link: not the job's straggler
            return []
        if call.node in self.flagged:  # called for its compute: its link is the cause
            self.kept.discard(call.node)
        # no compute figures: a link straggler computes about as long as its peers
        straggler = Straggler(
            call.node,
            call.slowdown,
            0.0,
            0.0,
            call.wait_s,
            call.wait_s,
            call.windows,
            cause="link",
            evidence=call.describe(),
        )
        self.flagged[call.node] = straggler
        self.lost[call.node] = max(self.links.lost_s, self.lost.get(call.node, 0.0))
        return [straggler]

    def judge(self, timings: dict[str, NodeTiming]) -> tuple[list[Straggler], list[str]]:
        """Take one window's timings; return the nodes newly called stragglers and the
        flagged nodes now back under the threshold."""
        called: list[Straggler] = []
        cleared: list[str] = []
        if len(timings) < 2:
            return called, cleared
        for node, mine in sorted(timings.items()):
            flagged = self.flagged.get(node)
            if flagged is not None and flagged.cause == "link":
                continue  # the link watch clears it
            peers = [t for n, t in timings.items() if n != node]
            median = statistics.median(t.compute_s for t in peers)
            if median <= 0:
                continue
            slowdown = mine.compute_s / median
            self.slowdowns[node] = round(slowdown, 3)
            slow = slowdown >= self.spec.threshold
            if slow or node in self.flagged:
                excess = max(mine.compute_s - median, 0.0) * mine.new_steps
                self.lost[node] = self.lost.get(node, 0.0) + excess
            else:
                self.lost.pop(node, None)
            if (node in self.flagged) == slow:
                self._streak[node] = 0  # no change of state under way
                continue
            self._streak[node] = self._streak.get(node, 0) + 1
            if self._streak[node] < self.spec.windows:
                continue
            self._streak[node] = 0
            if slow:
                peers_wait = statistics.median(t.wait_s for t in peers)
                straggler = Straggler(
                    node,
                    slowdown,
                    mine.compute_s,
                    median,
                    mine.wait_s,
                    peers_wait,
                    self.spec.windows,
                )
                self.flagged[node] = straggler
                called.append(straggler)
            else:
                del self.flagged[node]
                self.kept.discard(node)
                self.lost.pop(node, None)
                cleared.append(node)
        return called, cleared

    def forget(self, nodes: set[str]) -> None:
        """Nodes that left the job (failed, replaced) are judged afresh if they return."""
        for node in nodes:
            self.flagged.pop(node, None)
            self._streak.pop(node, None)
            self.slowdowns.pop(node, None)
            self.timings.pop(node, None)
            self.lost.pop(node, None)
            self.kept.discard(node)
        self.links.forget(nodes)
