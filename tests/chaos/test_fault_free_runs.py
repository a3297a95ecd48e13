"""Fault-free runs of an unmodified DDP script under ``ringmaster run``, many times over.

Each run is what a new user's first try is: a job file naming an ordinary
torchrun script (``tests/chaos/snapshot_ddp_worker.py``: DDP on gloo, rank 0
saves a snapshot every epoch, ``destroy_process_group`` without a barrier),
2 nodes and a warm spare, ``recovery: auto`` (which picks the restart tier),
a private etcd, a controller and three agents (:class:`~orchestrator.local_run.LocalRun`,
what ``ringmaster run`` runs).  Every run must end ``Succeeded`` with every
agent gone by itself; a run whose workers' teardown hangs stays Running and
fails here after :data:`RUN_TIMEOUT`.  Before the standby held the script's
process groups, 3 of 7 runs of a script of this shape hung that way here.

``RINGMASTER_FAULT_FREE_RUNS`` sets the number of runs: 1 by default (the
short form, in ``make test``); the long form is
``RINGMASTER_FAULT_FREE_RUNS=100 pytest -m chaos tests/chaos/test_fault_free_runs.py -s``
(about 15 s a run here), which prints one line per run and the count at the end.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.local_run import LocalRun
from orchestrator.spec.entrypoint import resolve_recovery
from orchestrator.spec.job import RecoveryMode
from orchestrator.spec.loader import load_job_data
from tests.chaos.jobs import REPO

RUNS = int(os.environ.get("RINGMASTER_FAULT_FREE_RUNS", "1"))
#: seconds one run may take (it takes about 10-15 s here)
RUN_TIMEOUT = 120

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300 + RUNS * RUN_TIMEOUT)]


def test_every_fault_free_run_ends(tmp_path: Path) -> None:
    ended: list[str] = []
    failed: list[str] = []
    for i in range(1, RUNS + 1):
        tmp = tmp_path / f"run-{i}"
        tmp.mkdir()
        spec, _ = resolve_recovery(
            load_job_data(
                {
                    "name": "snapshot-ddp",
                    "entrypoint": {
                        "script": str(REPO / "tests" / "chaos" / "snapshot_ddp_worker.py"),
                        "args": ["--epochs", "4", "--snapshot", str(tmp / "snapshot.pt")],
                    },
                    "nodes": {"min": 2, "max": 2, "spares": 1},
                    "checkpoint": {"url": f"file://{tmp}/ckpt"},
                    "fault_tolerance": {"recovery": "auto", "max_restarts": 0},
                }
            ),
            REPO,
        )
        assert spec.fault_tolerance.recovery is RecoveryMode.RESTART
        lines: list[str] = []
        started = time.monotonic()
        with LocalRun(
            spec, printer=lines.append, workdir=str(REPO), timeout=timedelta(seconds=RUN_TIMEOUT)
        ) as run:
            result = run.wait()
            agents = [p.popen for n, p in run.procs.items() if n.startswith("node-")]
            deadline = time.monotonic() + 10
            while any(p.poll() is None for p in agents) and time.monotonic() < deadline:
                time.sleep(0.05)
            lingering = sum(p.poll() is None for p in agents)
        took = time.monotonic() - started
        line = f"run {i}/{RUNS}: {result.phase.value} in {took:.1f}s"
        ok = result.phase is JobPhase.SUCCEEDED and not lingering
        if not ok:
            line += f", {lingering} agent(s) still running 10s after the end"
            failed.append(line + "\n" + "\n".join(lines[-40:]))
        ended.append(line)
        print(line, flush=True)
    print(f"{RUNS - len(failed)} of {RUNS} fault-free runs ended Succeeded", flush=True)
    assert not failed, "\n\n".join(failed)
