"""A CPU hog beside one node's workers, in bursts of random length: per-node noise.

On a cluster a co-tenant's process (a data job, a stray compile) takes CPU from
the workers of one host only.  Here every node of a job runs on the same cores,
so a burst is confined to one node: for its length, that node's processes
(every thread of its workers and of their children) are pinned to one core,
where 1 or 2 busy hog processes run as well, so the node runs at 1/2 to 1/3 of
that core while the other nodes keep every core; afterwards its processes get
their cores back and the hogs are stopped.  The bursts are seeded: 0.5 to 4 s
long, 2 to 30 s apart, 1 or 2 hogs (the CPU-hog scenario of
``tests/unit/test_straggler_noise.py``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["HogBursts"]

#: a burst's length, the gap before it (seconds, uniform) and the hogs in it
BURST_S = (0.5, 4.0)
GAP_S = (2.0, 30.0)
HOGS = (1, 2)
#: ``smoke``: gaps short enough for a burst within seconds
SMOKE_GAP_S = (0.5, 1.5)


def _threads(pids: list[int]) -> list[int]:
    """Every thread of ``pids`` and of their child processes (one level down)."""
    out: list[int] = []
    for pid in pids:
        task = Path(f"/proc/{pid}/task")
        with contextlib.suppress(OSError):
            for tid_dir in task.iterdir():
                out.append(int(tid_dir.name))
                with contextlib.suppress(OSError):
                    children = (tid_dir / "children").read_text().split()
                    out.extend(_threads([int(c) for c in children]))
    return out


def _pin(tids: list[int], cores: set[int]) -> None:
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cores)


class HogBursts(threading.Thread):
    """Hog bursts beside ``pids`` until :attr:`done` is set; :attr:`bursts` and
    :attr:`seconds` count them (a burst cut short by the end counts its part).
    ``smoke``: bursts 0.5 to 1.5 s apart (the code path, in seconds)."""

    def __init__(self, pids: list[int], seed: int, smoke: bool = False) -> None:
        super().__init__(daemon=True, name="cpu-hog-bursts")
        self.pids, self.rng = pids, random.Random(seed)
        self.done = threading.Event()
        self.bursts, self.seconds = 0, 0.0
        self.gaps = SMOKE_GAP_S if smoke else GAP_S
        self.every = os.sched_getaffinity(0)
        self.core = {min(self.every)}

    def _hogs(self) -> list[subprocess.Popen[bytes]]:
        hogs = []
        for _ in range(max(HOGS)):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            os.sched_setaffinity(hog.pid, self.core)
            hog.send_signal(signal.SIGSTOP)
            hogs.append(hog)
        return hogs

    def run(self) -> None:
        hogs = self._hogs()
        try:
            while not self.done.wait(self.rng.uniform(*self.gaps)):
                length, count = self.rng.uniform(*BURST_S), self.rng.randint(*HOGS)
                tids = _threads(self.pids)
                _pin(tids, self.core)
                for hog in hogs[:count]:
                    hog.send_signal(signal.SIGCONT)
                started = time.monotonic()
                self.done.wait(length)
                for hog in hogs[:count]:
                    hog.send_signal(signal.SIGSTOP)
                _pin(_threads(self.pids), self.every)
                self.bursts += 1
                self.seconds += time.monotonic() - started
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
