"""Slow links: a node whose network, not its compute, holds the job back.

Pure (no I/O), kept by :class:`~orchestrator.controller.stragglers.StragglerWatch`.
A slow link slows every rank alike: each waits longer in the gradient
all-reduce for the bytes that crawl through it, and no rank computes longer
(``benchmarks/slow_link.py`` measured it).  So the step timings can say *that*
a link is slow, not *which* node's:

1. **Suspect**, from the windows of step timings: the median node's wait per
   step has risen, over the least it was in this generation, by at least
   ``threshold - 1`` times the generation's fastest step (the job steps that
   much slower for waiting), and by at least twice what any node computes
   over its peers (a compute straggler makes the others wait about that
   much), for ``windows`` windows in a row.  (The node behind a slow link
   computes somewhat longer too, 1.2 to 1.5 times its peers in the tests
   here, while every rank's wait grows by several times that: it may be
   called a compute straggler first; the probe's verdict then names the
   cause.)
2. **Measure**: the controller asks every node's agent to stream bytes to the
   next two nodes' agents (:func:`probe_pairs`, :mod:`orchestrator.ports.link_probe`)
   and gets each pair's rate: the members' and the spares' (a third node tells
   which end of a slow pair is slow).
3. **Call** the node whose best link (the fastest pair it is in, sending or
   receiving) is :data:`LINK_GAP` times slower than every other node's best: all
   of its links are slow, and some without it are not.  That node is a
   straggler (``cause`` ``link``) as a compute straggler is, and swapped the same
   way.  A probe that calls nobody (the links are alike, or the network as a
   whole is slow) is not repeated for :data:`PROBE_COOLDOWN_S`.

A called node is cleared once the wait is back under the rise for ``windows``
windows.  What it costs the job (for ``confirm``) is the wait's rise times the
steps, summed from its first suspect window.

A link that was slow from a generation's start is not suspected: the rise is
measured against the generation's own best windows.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from orchestrator.spec.job import StragglerSpec

__all__ = [
    "LINK_GAP",
    "PEERS_PER_NODE",
    "PROBE_COOLDOWN_S",
    "LinkCall",
    "LinkProbeResult",
    "LinkWatch",
    "probe_pairs",
    "slow_end",
]

#: How many times slower a node's best link must be than every other node's best.
LINK_GAP = 2.0
#: Seconds after a probe before another one is asked for.
PROBE_COOLDOWN_S = 60.0
#: Peers each node streams to in a probe (:func:`probe_pairs`).
PEERS_PER_NODE = 2


@dataclass(frozen=True)
class LinkProbeResult:
    """What the agents measured: ``rates[sender][receiver]`` in bytes a second."""

    rates: dict[str, dict[str, float]]
    #: node → why it could not probe or be probed (it is left out of the verdict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LinkCall:
    """A node whose links are slow, and the evidence."""

    node: str
    #: its best link (bytes a second) and the slowest of the other nodes' best
    best_bps: float
    others_bps: float
    #: the median wait per step now and the least of the generation
    wait_s: float
    base_wait_s: float
    #: the job's step now over its fastest in the generation
    slowdown: float
    windows: int

    def describe(self) -> str:
        return (
            f"{self.node}'s link is slow: its fastest link to another node carries "
            f"{self.best_bps / 1e6:.1f} MB/s, every other node has one of "
            f"{self.others_bps / 1e6:.1f} MB/s or more; the ranks wait "
            f"{self.wait_s * 1000:.1f} ms per step for the gradient exchange (at least "
            f"{self.base_wait_s * 1000:.1f} ms before), and the job steps "
            f"{self.slowdown:.2f}x as long for {self.windows} windows in a row"
        )


def probe_pairs(nodes: list[str], per_node: int = PEERS_PER_NODE) -> dict[str, list[str]]:
    """Whom each node streams to: the next ``per_node`` nodes in ``nodes``' order, round
    the end (every pair when there are few nodes).  Each node is then in ``2 x
    per_node`` pairs, so one slow node's pairs are all slow while each other node has
    a pair without it, and a probe of ``n`` nodes takes ``n x per_node`` tries, not
    ``n x (n - 1)``."""
    n = len(nodes)
    k = min(per_node, n - 1)
    return {node: [nodes[(i + j) % n] for j in range(1, k + 1)] for i, node in enumerate(nodes)}


def best_links(result: LinkProbeResult) -> dict[str, float]:
    """Each node's fastest measured pair, as sender or receiver."""
    best: dict[str, float] = {}
    for sender, row in result.rates.items():
        for receiver, bps in row.items():
            for node in (sender, receiver):
                if node not in result.errors:
                    best[node] = max(best.get(node, 0.0), bps)
    return best


def slow_end(result: LinkProbeResult) -> tuple[str, float, float] | None:
    """The node all of whose links are :data:`LINK_GAP` times slower than every other
    node's best (at most one can be), with its best and the others' least best."""
    best = best_links(result)
    for node, mine in sorted(best.items()):
        others = [b for n, b in best.items() if n != node]
        if len(others) >= 2 and mine * LINK_GAP <= min(others):
            return node, mine, min(others)
    return None


@dataclass
class LinkWatch:
    """Suspects, measures and calls slow links, window after window (see the module
    docstring)."""

    spec: StragglerSpec
    generation: int = 0
    #: the least median wait per step and the fastest median step of the generation
    base_wait_s: float | None = None
    base_step_s: float | None = None
    #: windows in a row the wait stayed risen (below, for a called node)
    streak: int = 0
    #: what the rise cost the job over the streak (steps x seconds)
    lost_s: float = 0.0
    #: the latest window's median wait and step slowdown
    wait_s: float = 0.0
    slowdown: float = 1.0
    #: a probe was asked for and its result is not in yet
    probing: bool = False
    #: ``mono`` of the last probe asked for
    asked_at: float | None = None
    #: the node called for its link now, if any
    called: LinkCall | None = None

    def window(
        self, generation: int, timings: dict[str, tuple[float, float, int]], mono: float
    ) -> tuple[bool, float, bool]:
        """Take one window: per node ``(compute_s, wait_s, steps)`` per step.

        Returns:
            Whether to ask for a probe now, what the rise cost the job in this
            window (seconds), and whether the called node is cleared.
        """
        if generation != self.generation:
            self.generation, self.base_wait_s, self.base_step_s = generation, None, None
            self.streak, self.lost_s, self.called = 0, 0.0, None
        if len(timings) < 2:
            return False, 0.0, False
        waits = [w for _, w, _ in timings.values()]
        steps = [c + w for c, w, _ in timings.values()]
        wait, step = statistics.median(waits), statistics.median(steps)
        n = statistics.median(s for _, _, s in timings.values())
        self.base_wait_s = wait if self.base_wait_s is None else min(self.base_wait_s, wait)
        self.base_step_s = step if self.base_step_s is None else min(self.base_step_s, step)
        rise = wait - self.base_wait_s
        self.wait_s, self.slowdown = wait, step / self.base_step_s if self.base_step_s else 1.0
        # a node that computes longer makes its peers wait about that much more: a rise
        # it does not explain by half is the network's
        risen = rise >= (self.spec.threshold - 1.0) * self.base_step_s
        risen = risen and rise >= 2.0 * _compute_excess(timings)
        cost = max(rise, 0.0) * n
        if self.called is not None:
            self.streak = 0 if risen else self.streak + 1
            if self.streak >= self.spec.windows:
                self.called, self.streak, self.lost_s = None, 0, 0.0
                return False, 0.0, True
            return False, cost, False
        self.streak = self.streak + 1 if risen else 0
        self.lost_s = self.lost_s + cost if risen else 0.0
        if self.streak < self.spec.windows or self.probing:
            return False, 0.0, False
        if self.asked_at is not None and mono - self.asked_at < PROBE_COOLDOWN_S:
            return False, 0.0, False
        self.probing, self.asked_at = True, mono
        return True, 0.0, False

    def verdict(self, result: LinkProbeResult) -> LinkCall | None:
        """Take a probe's result: the node called for its link, if the figures say one."""
        self.probing = False
        found = slow_end(result)
        if found is None or self.base_wait_s is None:
            return None
        node, mine, others = found
        self.called = LinkCall(
            node, mine, others, self.wait_s, self.base_wait_s, self.slowdown, self.streak
        )
        self.streak = 0
        return self.called

    def forget(self, nodes: set[str]) -> None:
        """A called node that left the job (swapped out, failed) is no longer called."""
        if self.called is not None and self.called.node in nodes:
            self.called, self.streak, self.lost_s = None, 0, 0.0


def _compute_excess(timings: dict[str, tuple[float, float, int]]) -> float:
    """The most any node computes per step over its peers' median (seconds)."""
    most = 0.0
    for node, (compute, _, _) in timings.items():
        peers = [c for n, (c, _, _) in timings.items() if n != node]
        if peers:
            most = max(most, compute - statistics.median(peers))
    return most
