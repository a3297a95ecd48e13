"""The processes of the control-plane benchmark, and what follows them.

:class:`Slice` is one fleet process (:mod:`benchmarks._control_plane.fleet`)
and its command pipe, :class:`ControllerProcess` the real controller,
:class:`PlanLog` every plan written (seen by a watch of the benchmark's own),
:class:`Sampler` etcd's metrics every few seconds.  Every wait has a deadline;
past it, or when a process dies, a :class:`BenchError` carries the process's
log tail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._control_plane import etcd_metrics
from benchmarks._control_plane.etcd_server import Etcd, process_cpu_s
from benchmarks._control_plane.fleet import FleetConfig, node_name
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.grpc_env import grpc_environment
from orchestrator.process_lifetime import die_with_parent
from orchestrator.state import keys, records
from orchestrator.state.records import Plan

REPO = Path(__file__).resolve().parents[2]
#: How long one command to a fleet process may take, and its stop.
CALL_S = 60.0
STOP_S = 20.0
#: How often etcd's metrics are scraped.
SAMPLE_EVERY_S = 5.0


class BenchError(RuntimeError):
    """A wait ran past its deadline, or a process of the benchmark died."""


class Slice:
    """One fleet process (:mod:`benchmarks._control_plane.fleet`) and its command pipe."""

    def __init__(self, cfg: FleetConfig, log_path: Path) -> None:
        self.cfg = cfg
        self.name = f"{node_name(cfg.first)}..{node_name(cfg.first + cfg.count - 1)}"
        self.log_path = log_path
        env = {**grpc_environment(), **os.environ}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                die_with_parent(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks._control_plane.fleet",
                        "--config",
                        json.dumps(dataclasses.asdict(cfg)),
                    ]
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=REPO,
                env=env,
            )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._replies.put(json.loads(line))
        self._replies.put(None)

    def owns(self, node: str) -> bool:
        return node in self.cfg.node_names

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            raise BenchError(f"fleet slice {self.name} is gone ({e}):\n{self.tail()}") from e

    def recv(self, cmd: str, timeout: float) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(
                f"fleet slice {self.name} did not answer {cmd!r} within {timeout:g}s; its log:\n"
                f"{self.tail()}"
            ) from None
        if reply is None:
            raise BenchError(
                f"fleet slice {self.name} exited (code {self.proc.poll()}) while asked {cmd!r}; "
                f"its log:\n{self.tail()}"
            )
        return reply

    def call(self, cmd: str, timeout: float = CALL_S, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        return self.recv(cmd, timeout)

    def tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def close(self) -> None:
        """Stop the slice (after a ``stop`` was sent, or sending one now)."""
        if self.proc.poll() is None:
            with contextlib.suppress(BenchError):
                self.send("stop")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_S)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def call_all(slices: list[Slice], cmd: str, timeout: float = CALL_S, **args: Any) -> list[dict]:
    """Send ``cmd`` to every slice, then collect the answers (the slices work in parallel)."""
    for s in slices:
        s.send(cmd, **args)
    return [s.recv(cmd, timeout) for s in slices]


class ControllerProcess:
    """``ringmaster controller`` for the job, with its metrics endpoint (as a local run)."""

    def __init__(self, etcd: Etcd, job: str, log_path: Path) -> None:
        self.log_path = log_path
        # INFO: its probe rounds are read back from the log (probe_rounds)
        env = {**grpc_environment(), **os.environ, "RINGMASTER_LOG_LEVEL": "INFO"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                die_with_parent(
                    [
                        sys.executable,
                        "-m",
                        "orchestrator.cli",
                        "controller",
                        "--job",
                        job,
                        "--metrics-port",
                        "0",
                        "--etcd",
                        ",".join(etcd.endpoints),
                    ]
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                # the job's checkpoint.url (./checkpoints) is the run's own: a run that
                # was killed leaves no writer marker where the next one writes
                cwd=log_path.parent,
                env=env,
            )

    def cpu_s(self) -> float:
        return process_cpu_s(self.proc.pid)

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError(
                f"the controller exited with code {self.proc.returncode}:\n{self.tail()}"
            )

    def tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def log_size(self) -> int:
        with contextlib.suppress(OSError):
            return self.log_path.stat().st_size
        return 0

    def probe_rounds(self, since: int) -> list[tuple[int, float]]:
        """The controller's probe rounds logged after byte ``since``: (members, seconds)."""
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
            return [
                (int(n), float(s))
                for n, s in re.findall(r"probed (\d+) silent member\(s\) in ([\d.]+)s", text)
            ]
        return []

    def errors(self) -> dict[str, int]:
        """The controller's etcd errors (``etcd unavailable, retrying: ...``), by message."""
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in self.log_path.read_text(errors="replace").splitlines():
                if "etcd unavailable" in line or "Error" in line:
                    message = re.sub(r"^\S+ \S+ ", "", line)  # the time stamp
                    message = re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "#", message)[:200]
                    out[message] = out.get(message, 0) + 1
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class PlanLog:
    """Every plan written, with the wall time this process's watch saw it."""

    def __init__(self, client: EtcdClient, job: str) -> None:
        #: (wall time seen, plan, its mod_revision)
        self.seen: list[tuple[float, Plan, int]] = []
        self._cond = threading.Condition()
        self._watch = client.watch(keys.job_plan(job))
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        with contextlib.suppress(Exception):  # cancelled at the end
            for ev in self._watch:
                if ev.value is None:
                    continue
                plan = records.decode(Plan, ev.value, ev.key)
                with self._cond:
                    self.seen.append((time.time(), plan, ev.mod_revision))
                    self._cond.notify_all()

    def wait_newer(
        self, generation: int, timeout: float, check: Callable[[], None]
    ) -> tuple[float, Plan, int]:
        """The first plan newer than ``generation`` and when it was seen.

        Raises:
            BenchError: none within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for at, plan, revision in self.seen:
                    if plan.generation > generation:
                        return at, plan, revision
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(
                        f"no plan newer than generation {generation} within {timeout:g}s"
                    )
                self._cond.wait(min(left, 0.5))
                check()

    def cancel(self) -> None:
        with contextlib.suppress(Exception):
            self._watch.cancel()


class Sampler:
    """etcd's metrics every :data:`SAMPLE_EVERY_S` seconds, in a thread."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = urls
        self.scrapes: list[etcd_metrics.Scrape] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.now()
            if self._stop.wait(SAMPLE_EVERY_S):
                return

    def now(self) -> etcd_metrics.Scrape | None:
        try:
            s = etcd_metrics.scrape(self.urls)
        except OSError as e:
            self.errors.append(str(e))
            return None
        self.scrapes.append(s)
        return s

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
