"""Start ``ringmaster`` service processes for a fault test and always clean them up.

:class:`Services` spawns ``python -m orchestrator.cli <command>`` processes
(optionally behind a prefix such as ``ip netns exec <ns>``), each in a process
group of its own (:func:`orchestrator.process_lifetime.start_group`), collects
their output as ``[name] line`` into ``lines``, and on exit stops every process
it started (the stop sequence, a node's whole process tree at the end), even
after a failed test.  SIGKILL to a node is a machine's death: the agent, its
workers (each in a group of their own) and whatever they started.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from orchestrator.process_lifetime import kill_tree, start_group, stop_groups

REPO = Path(__file__).resolve().parents[2]


class Services:
    """A set of named service processes; see the module docstring."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._threads: list[threading.Thread] = []

    def start(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``ringmaster <args>`` as ``name`` (behind ``prefix`` if given), in ``cwd``
        (default: the repository; an agent's workers start where it does)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        argv = [*(prefix or []), sys.executable, "-m", "orchestrator.cli", *args]
        popen = start_group(
            argv, cwd=cwd or REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.procs[name] = popen
        t = threading.Thread(target=self._pump, args=(name, popen.stdout), daemon=True)
        t.start()
        self._threads.append(t)
        return popen

    def _pump(self, name: str, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        for raw in iter(stream.readline, b""):
            self.lines.append(f"[{name}] {raw.decode(errors='replace').rstrip()}")

    def signal(self, name: str, sig: int) -> None:
        """Signal ``name``'s process group; SIGKILL goes to every process it started too
        (a node's death: the agent, its workers and what they started)."""
        proc = self.procs[name]
        if sig == signal.SIGKILL and proc.returncode is None:
            kill_tree(proc.pid)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process group, SIGKILL every process tree left after ``timeout``."""
        stop_groups(self.procs.values(), timeout, whole_tree=True)
        for t in self._threads:
            t.join(timeout=2)
        for p in self.procs.values():
            if p.stdout is not None:
                p.stdout.close()

    def __enter__(self) -> Services:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def still_running(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Those of ``pids`` that have not exited within ``timeout`` seconds (one deadline).

    Waits on each process's pidfd (readable once it exited, a zombie included), so
    it needs no parent-child relation and no polling.
    """
    deadline = time.monotonic() + timeout
    alive = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # gone (and reaped)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            left = max(deadline - time.monotonic(), 0.0)
            if not poller.poll(int(left * 1000)):
                alive.append(pid)
        finally:
            os.close(fd)
    return alive
