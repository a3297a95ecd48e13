"""A machine slowed from outside: processes stopped and continued by signals.

A throttled or contended machine runs its processes part of the time.  A
:class:`DutyCycle` does that to chosen processes: SIGSTOP for ``stopped``
seconds of every ``period``, SIGCONT for the rest, until told to end (then
SIGCONT, so nothing is left stopped).  Used by the straggler tests and the
straggler benchmark.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

__all__ = ["DutyCycle", "stopped_share"]


def stopped_share(factor: float) -> float:
    """The share of each period stopped for a process to run ``factor`` times slower."""
    return 1.0 - 1.0 / factor


class DutyCycle(threading.Thread):
    """SIGSTOP ``pids`` for ``stopped`` s of every ``period`` s until :attr:`done` is set."""

    def __init__(self, pids: list[int], period: float = 0.1, stopped: float = 0.06) -> None:
        super().__init__(daemon=True, name="duty-cycle")
        self.pids, self.period, self.stopped = pids, period, stopped
        self.done = threading.Event()

    def _send(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self._send(signal.SIGSTOP)
                self.done.wait(self.stopped)
                self._send(signal.SIGCONT)
                self.done.wait(self.period - self.stopped)
        finally:
            self._send(signal.SIGCONT)
