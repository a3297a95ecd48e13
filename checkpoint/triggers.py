"""When to save: every N steps, every T seconds, or on request.

:class:`SaveTrigger` is a pure decision helper.  Step-based triggers agree
across ranks by construction; time-based ones do not (clocks differ), so
:class:`~checkpoint.checkpointer.Checkpointer` takes rank 0's answer.
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
from typing import Any


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

    def due(self, step: int) -> str | None:
        """Why ``step`` should be saved (``"every 100 steps"``...), or None."""
        if self._requested is not None:
            return self._requested
        if self.every_steps and step > 0 and step % self.every_steps == 0:
            return f"every {self.every_steps} steps"
        if self.every_seconds and self._clock() - self._last_save >= self.every_seconds:
            return f"every {self.every_seconds:g}s"
        return None

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
