"""Run the two ranks of tests/faults/stuck_pair_worker.py and stop one of them.

Rank 1 is SIGSTOPped once it is ready; after ``pause`` seconds the newer
generation is announced (the file the workers' guard watches); rank 0's
report of how its stuck all-reduce ended is returned.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("stuck_pair_worker.py")


def run_stuck_pair(
    etcd_endpoint: str,
    tmp: Path,
    *,
    backend: str,
    op_timeout: float,
    pause: float = 0.0,
    between_sites: bool = False,
) -> dict[str, Any]:
    moved, out = tmp / "moved", tmp / "rank0.json"
    args = [
        etcd_endpoint,
        f"stuck-{uuid.uuid4().hex[:8]}",
        "--moved",
        str(moved),
        "--out",
        str(out),
        "--backend",
        backend,
        "--op-timeout",
        str(op_timeout),
        *(["--between-sites"] if between_sites else []),
    ]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), *args], env=env) for r in (0, 1)
    ]
    try:
        ready = tmp / "rank1.ready"
        deadline = time.monotonic() + 120
        while not ready.exists():
            if time.monotonic() > deadline:
                raise AssertionError("rank 1 never became ready")
            time.sleep(0.05)
        os.kill(int(ready.read_text()), signal.SIGSTOP)
        time.sleep(pause)
        moved.touch()  # the controller's new generation, as the guard sees it
        if procs[0].wait(timeout=30) != 0:
            raise AssertionError(f"rank 0 exited with {procs[0].returncode}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
