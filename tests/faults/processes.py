"""Start ``ringmaster`` service processes for a fault test and always clean them up.

:class:`Services` spawns ``python -m orchestrator.cli <command>`` processes
(optionally behind a prefix such as ``ip netns exec <ns>``), each in its own
session so a whole node (agent and its workers) is signalled at once,
collects their output as ``[name] line`` into ``lines``, and on exit stops
every process it started, by process group, even after a failed test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import IO

from orchestrator.process_lifetime import tie_to_parent

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
    ) -> subprocess.Popen[bytes]:
        """Start ``ringmaster <args>`` as ``name`` (behind ``prefix`` if given)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        argv = [*(prefix or []), sys.executable, "-m", "orchestrator.cli", *args]
        popen = subprocess.Popen(
            argv,
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=tie_to_parent(),
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
        """Signal the whole process group of ``name`` (a node: agent and workers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``timeout``."""
        for name in self.procs:
            self.signal(name, signal.SIGTERM)
        for name, p in self.procs.items():
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(name, signal.SIGKILL)
                p.wait()
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
