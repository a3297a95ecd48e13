"""A node's failure as ``ringmaster run`` prints it: the cause first, what followed folded.

In the restart tier, when a node dies its peers' workers die too, on the
collective the dead node left (gloo's ``Connection reset by peer``).  Their
tracebacks reach the run's output at once, their agents' ``worker ... failed``
lines and ``WorkerExited`` events right after, and the controller's
``NodeFailed`` event only once it has probed the silent node: read in that
order, the break looks like the survivor's fault.

:class:`ConsequenceFolder` holds, for up to :data:`HOLD_S`, a worker's
traceback (a block that starts ``Traceback (most recent call last):``, with
torch's ``[rankN]:`` prefix or without), an agent's ``worker ... failed in
generation`` line, a ``WorkerExited`` event, and the events that come while
any of these is held.  When a ``NodeFailed`` event arrives, it is printed
first; what other nodes printed before it is printed as one line per node,
marked as a consequence of that failure (the whole traceback stays in
``ringmaster logs``); then the held events in their order.  When a
``Restart`` or a final phase comes instead (the script's own error), or
nothing comes for :data:`HOLD_S`, everything held is printed as it came.
Runs in the CLI (``ringmaster run``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.state.records import Event

__all__ = ["HOLD_S", "ConsequenceFolder"]

#: The longest a worker's traceback waits for the failure that may explain it (seconds):
#: the controller probes a silent node at once and waits at most about a second for
#: reports, a lease expiry takes a few seconds.
HOLD_S = 5.0
#: A traceback longer than this is printed as it comes (not a crash in a collective).
MAX_BLOCK = 400

_PREFIX = r"(?P<prefix>\[rank\d+\]:\s?)?"
_START = re.compile(_PREFIX + r"Traceback \(most recent call last\):\s*$")
_CHAINED = ("During handling of the above exception", "The above exception was the direct")
_WORKER_FAILED = re.compile(r"\bworker \S+ failed in generation \d+")
#: Events that settle a break as the script's own (or end the job): nothing to fold.
_SETTLING = ("Restart",)


@dataclass
class _Held:
    """What one node printed (or had said for it) while a break was being settled."""

    node: str
    lines: list[str] = field(default_factory=list)
    #: the line that names the error: a traceback's last line, or the exit's message
    summary: str = ""


@dataclass
class _Block:
    """A traceback being read, line by line, from one process's output."""

    prefix: str
    lines: list[str]


class ConsequenceFolder:
    """Orders and folds the output after a failure (see the module docstring).

    Args:
        job: the job's name (for the ``ringmaster logs`` hint).
        line: prints one line of a process's output, already prefixed ``[name]``.
        event: prints one event.
        clock: monotonic time (tests pass their own).
    """

    def __init__(
        self,
        job: str,
        line: Callable[[str], None],
        event: Callable[[Event], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self._line = line
        self._event = event
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks: dict[str, _Block] = {}
        self._held: list[_Held] = []
        self._events: list[Event] = []
        self._since: float | None = None

    # -- input -------------------------------------------------------------------------

    def output(self, name: str, text: str) -> None:
        """One line a process (a node agent, a controller) printed, without its prefix."""
        with self._lock:
            block = self._blocks.get(name)
            if block is not None:
                self._continue(name, block, text)
                return
            start = _START.match(text)
            if start is not None and name.startswith("node"):
                self._blocks[name] = _Block(start.group("prefix") or "", [text])
                self._hold_from()
                return
            if _WORKER_FAILED.search(text) and name.startswith("node"):
                self._hold(name, f"[{name}] {text}", _after(text, "failed in generation"))
                return
        self._line(f"[{name}] {text}")

    def event(self, ev: Event) -> None:
        """One event of the job's log, in its order."""
        release: list[Event] = []
        with self._lock:
            if ev.type == "NodeFailed" and (self._held or self._blocks or self._events):
                self._fold(ev)
                return
            if ev.type == "WorkerExited" and ev.source != "controller":
                self._hold(str(ev.data.get("node") or ev.source), None, ev.message, ev)
                return
            if self._since is None:
                release = [ev]
            elif ev.type in _SETTLING or _final_phase(ev):
                self._events.append(ev)
                self._flush()
                return
            else:
                self._events.append(ev)
        for e in release:
            self._event(e)

    def tick(self) -> None:
        """Print what was held for :data:`HOLD_S` as it came (call it now and then)."""
        with self._lock:
            if self._since is not None and self._clock() - self._since >= HOLD_S:
                for name in list(self._blocks):
                    self._end_block(name)
                self._flush()

    def flush(self) -> None:
        """Print everything held, as it came (the run ends)."""
        with self._lock:
            for name in list(self._blocks):
                self._end_block(name)
            self._flush()

    # -- holding -----------------------------------------------------------------------

    def _hold_from(self) -> None:
        if self._since is None:
            self._since = self._clock()

    def _hold(self, node: str, line: str | None, summary: str, ev: Event | None = None) -> None:
        self._hold_from()
        held = _Held(node, [line] if line else [], summary)
        if ev is not None:
            self._events.append(ev)  # printed as it came unless a failure explains it
            held.lines = []
        self._held.append(held)

    def _continue(self, name: str, block: _Block, text: str) -> None:
        body = text[len(block.prefix) :] if text.startswith(block.prefix) else None
        block.lines.append(text)
        if body is None or len(block.lines) > MAX_BLOCK:
            self._end_block(name)
            return
        if not body.strip() or body[:1].isspace() or body.startswith(_CHAINED):
            return
        if _START.match(text):
            return
        self._end_block(name)  # the exception's own line ends the traceback

    def _end_block(self, name: str) -> None:
        block = self._blocks.pop(name)
        held = _Held(name, [f"[{name}] {x}" for x in block.lines], block.lines[-1].strip())
        self._held.append(held)

    # -- releasing ---------------------------------------------------------------------

    def _fold(self, failed: Event) -> None:
        """``failed`` first, then each other node's held output as one line, then the
        held events (but the folded exits)."""
        node = str(failed.data.get("node") or "")
        for name in list(self._blocks):
            self._end_block(name)
        self._event(failed)
        mine = [h for h in self._held if h.node == node]
        others: dict[str, list[_Held]] = {}
        for h in self._held:
            if h.node != node:
                others.setdefault(h.node, []).append(h)
        for h in mine:
            for line in h.lines:
                self._line(line)
        for other, held in others.items():
            count = sum(len(h.lines) for h in held)
            summary = next((h.summary for h in held if h.summary), "")
            folded = f" ({count} lines folded: `ringmaster logs {self.job} --node {other}`)"
            self._line(
                f"[{other}] after {node} failed (a consequence, not the cause): {summary}"
                + (folded if count else "")
            )
        folded_exits = {id(e) for e in self._events if _exit_of(e, others)}
        for e in self._events:
            if id(e) not in folded_exits:
                self._event(e)
        self._held, self._events, self._since = [], [], None

    def _flush(self) -> None:
        for h in self._held:
            for line in h.lines:
                self._line(line)
        for e in self._events:
            self._event(e)
        self._held, self._events = [], []
        self._since = self._clock() if self._blocks else None


def _after(text: str, marker: str) -> str:
    """``text`` from ``marker`` on (an agent's log line without its time)."""
    at = text.find(marker)
    return text[at:] if at >= 0 else text


def _final_phase(ev: Event) -> bool:
    return ev.type == "Phase" and ev.message.startswith(("Failed", "Succeeded", "Stopped"))


def _exit_of(ev: Event, nodes: dict[str, list[_Held]]) -> bool:
    """A ``WorkerExited`` event of one of the folded nodes."""
    return ev.type == "WorkerExited" and str(ev.data.get("node") or ev.source) in nodes
