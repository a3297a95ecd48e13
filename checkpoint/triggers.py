"""When to save: every N steps, every T seconds, or on request.

:meth:`SaveTrigger.decide` is the one rule for when a save is due, for every
user of checkpoints: a request first, then every ``every_steps`` steps, then
``every_seconds`` since the last save.  Step-based saves agree across ranks by
construction; a request and a clock are one rank's, so ranks agree on those
inputs before they decide, and the two users do it differently:

* :class:`~checkpoint.checkpointer.Checkpointer` (a library in any training
  loop) takes rank 0's answer, one small broadcast per step;
* the ringmaster worker runtime votes at its step boundary
  (:mod:`agents.runtime.boundary`, a vote it casts anyway): a request is a
  counter of the controller's, and the time is due when it is due on any
  rank; it passes the agreed answers to :meth:`SaveTrigger.decide`.

Requests from outside the loop (a controller command, SIGTERM preemption)
go through :meth:`SaveTrigger.request`, which is safe to call from a signal
handler or another thread; the next check returns True and says why.
:func:`request_on_signal` installs such a handler for SIGTERM.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["SaveDue", "SaveTrigger", "request_on_signal"]


@dataclass(frozen=True)
class SaveDue:
    """Why a step is saved (:meth:`SaveTrigger.decide`)."""

    #: as logged: the request's reason, ``every 100 steps`` or ``every 30s``
    reason: str
    #: a request (served once) rather than the periodic schedule
    requested: bool


class SaveTrigger:
    """Decides whether the current step should be checkpointed.

    Args:
        every_steps: save when ``step`` is a multiple of this (0: off).
        every_seconds: save when this many seconds passed since the last save (0: off).
        clock: monotonic clock, injectable for tests.
    """

    def __init__(
        self,
        every_steps: int = 0,
        every_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_steps < 0 or every_seconds < 0:
            raise ValueError(
                f"every_steps ({every_steps}) and every_seconds ({every_seconds:g}) "
                "must be 0 (off) or positive"
            )
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._clock = clock
        self._last_save = clock()
        self._requested: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, spec: Any) -> SaveTrigger:
        """From a job spec's checkpoint section (``every_steps``, ``every_seconds``)."""
        return cls(every_steps=int(spec.every_steps), every_seconds=float(spec.every_seconds))

    def request(self, reason: str = "requested") -> None:
        """Ask for a save at the next check (thread- and signal-safe)."""
        self._requested = reason

    @property
    def pending_request(self) -> str | None:
        """The reason of a request not yet served, if any."""
        return self._requested

    def is_time_based(self) -> bool:
        return self.every_seconds > 0

    def time_due(self) -> bool:
        """``every_seconds`` have passed since the last save, on this process's clock."""
        return bool(self.every_seconds) and self._clock() - self._last_save >= self.every_seconds

    def decide(
        self, step: int, *, requested: str | None = None, time_due: bool | None = None
    ) -> SaveDue | None:
        """Whether ``step`` is saved, and why: the one rule (see the module docstring).

        Args:
            step: the step just completed.
            requested: a request the ranks agreed on (its reason); None: this
                trigger's own pending request, if any.
            time_due: whether ``every_seconds`` passed, as the ranks agreed;
                None: this process's clock (:meth:`time_due`).
        """
        request = self._requested if requested is None else requested
        if request is not None:
            return SaveDue(request, requested=True)
        if self.every_steps and step > 0 and step % self.every_steps == 0:
            return SaveDue(f"every {self.every_steps} steps", requested=False)
        if self.time_due() if time_due is None else time_due:
            return SaveDue(f"every {self.every_seconds:g}s", requested=False)
        return None

    def due(self, step: int) -> str | None:
        """Why ``step`` should be saved (``"every 100 steps"``...), or None."""
        decided = self.decide(step)
        return None if decided is None else decided.reason

    def saved(self) -> None:
        """Record that a save was started now (clears a pending request)."""
        with self._lock:
            self._requested = None
            self._last_save = self._clock()


def request_on_signal(trigger: SaveTrigger, signum: int = signal.SIGTERM) -> Any:
    """Make ``signum`` (SIGTERM: preemption) request a save instead of killing the process.

    The training loop's next :meth:`~checkpoint.checkpointer.Checkpointer.maybe_save`
    then saves on every rank at the same step; the caller decides what to do
    after that save (typically finish it with ``wait()`` and exit within the
    grace period).  Must be called from the main thread.

    Returns:
        The previous handler, to restore with ``signal.signal(signum, previous)``.
    """

    def _handler(received: int, frame: Any) -> None:
        trigger.request(f"preemption ({signal.Signals(received).name})")

    return signal.signal(signum, _handler)
