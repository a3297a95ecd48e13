"""What `ringmaster run` leaves a person with: a final table that wraps, and a `logs`
hint that works once the run (and its own etcd) is gone.

Real processes: ``ringmaster run`` as a subprocess whose output is a pipe (not a
terminal), a restart-tier script that prints a line and raises, then
``ringmaster logs`` afterwards with no etcd given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.processes import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

JOB = "a-restart-tier-job-with-a-long-name"


def _cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_the_logs_hint_after_run_works_without_the_runs_etcd(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('hello from the script', flush=True)\n"
        "raise ValueError('boom in the script')\n"
    )
    (tmp_path / "job.yaml").write_text(
        f"name: {JOB}\nentrypoint: train.py\nnodes: {{min: 1, max: 1}}\n"
        "fault_tolerance: {max_restarts: 0}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    env.pop("COLUMNS", None)
    env |= {"RINGMASTER_LOG_DIR": str(tmp_path / "logs"), "PYTHONPATH": str(REPO)}
    run = _cli(["run", "job.yaml", "--timeout", "120"], tmp_path, env)
    out = run.stdout
    assert run.returncode == 1, out[-3000:] + run.stderr[-3000:]
    assert f"see `ringmaster logs {JOB}`" in out, out[-3000:]
    assert f"the run's etcd ended with it: `ringmaster logs {JOB}` reads" in " ".join(
        out.split()
    ), out[-1500:]
    # the final table: what the tier knows, wrapped at 80 columns, nothing cut
    # (from its header row on: the workers' last lines may come after "leaving: job Failed")
    header = out.rindex("│ phase")
    table = out[out.rindex("\n", 0, header) :]
    assert "…" not in table and "Failed" in table, table
    assert table.count("reported") == 2 and table.count("script") == 2, table  # steps, effective

    logs = _cli(["logs", JOB], tmp_path, env)
    assert logs.returncode == 0, logs.stdout + logs.stderr
    assert "[node-0/0] hello from the script" in logs.stdout, logs.stdout
    assert "ValueError: boom in the script" in logs.stdout, logs.stdout
    assert "no etcd given: reading this machine's files in" in logs.stderr, logs.stderr
    tail = _cli(["logs", JOB, "--node", "node-0", "--tail", "1"], tmp_path, env)
    assert tail.returncode == 0 and len(tail.stdout.splitlines()) == 1, tail.stdout
    other = _cli(["logs", "no-such-job"], tmp_path, env)
    assert other.returncode == 1 and "no output of job 'no-such-job' on this machine" in (
        other.stderr
    ), other.stderr
