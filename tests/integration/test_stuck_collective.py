"""A gloo collective stuck on a SIGSTOPped peer ends at the guard's operation
timeout, whatever the abort does (gloo's abort does not interrupt a wait).

Two real processes form a gloo generation with the runtime's ``form_group``
and guard it with a :class:`~agents.collective_guard.CollectiveGuard`
(tests/faults/stuck_pair_worker.py); rank 1 is SIGSTOPped, the test then
announces a newer generation, and rank 0 reports what ended its all-reduce.
The two-GPU NCCL twin of this test (tests/cuda/test_nccl_groups.py) expects
the abort to end it instead.
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

import pytest

from orchestrator.etcd.embedded import EmbeddedEtcd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "faults" / "stuck_pair_worker.py"
OP_TIMEOUT_S = 2.0


def test_gloo_wait_on_a_stopped_peer_ends_at_the_operation_timeout(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    moved, out = tmp_path / "moved", tmp_path / "rank0.json"
    args = [etcd.endpoint, f"stuck-{uuid.uuid4().hex[:8]}", "--moved", str(moved),
            "--out", str(out), "--backend", "gloo", "--op-timeout", str(OP_TIMEOUT_S)]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), *args], env=env) for r in (0, 1)
    ]
    try:
        ready = tmp_path / "rank1.ready"
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "rank 1 never became ready"
            time.sleep(0.05)
        os.kill(int(ready.read_text()), signal.SIGSTOP)
        moved.touch()  # the controller's new generation, as the guard sees it
        assert procs[0].wait(timeout=30) == 0
        result = json.loads(out.read_text())
        assert result["ended_by"] == "timeout", result
        # the learnt timeout, not torch's default (30 min) or twice hang_timeout
        assert 1.0 < result["seconds"] < 10.0, result
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
