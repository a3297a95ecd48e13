"""SIGTERM to ``ringmaster run`` (what ``timeout``, systemd or a batch scheduler send)
ends the run as Ctrl-C does: the job saves at one step and stops, the run leaves
nothing in ``TMPDIR`` and its checkpoint root is free for the next run.

Real processes: ``ringmaster run`` as a subprocess with an embedded etcd, an
in-process job whose workers log each step they apply; the signal is sent once the
steps are seen.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint.catalog import checkpoints
from orchestrator.checkpoint_root.writer_marker import MARKER_NAME
from tests.faults.processes import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


def _steps_logged(directory: Path) -> int:
    """Steps applied so far (one line each, across the job's workers)."""
    return sum(len(f.read_text().splitlines()) for f in directory.iterdir() if f.is_file())


def test_sigterm_to_run_saves_stops_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    steps, tmpdir = tmp_path / "steps", tmp_path / "tmp"
    steps.mkdir()
    tmpdir.mkdir()
    script = REPO / "examples" / "train_tiny.py"
    (tmp_path / "job.yaml").write_text(
        "name: sigterm-job\n"
        f"entrypoint: {{script: {script}, args: [--step-time, '0.05', --step-log, {steps}]}}\n"
        "nodes: {min: 1, max: 1}\n"
        "max_steps: 100000\n"
        f"checkpoint: {{url: 'file://{tmp_path}/ckpt', every_steps: 0}}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    env |= {
        "TMPDIR": str(tmpdir),
        "RINGMASTER_LOG_DIR": str(tmp_path / "logs"),
        "PYTHONPATH": str(REPO),
    }
    with (tmp_path / "out.txt").open("w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "run", "job.yaml", "--timeout", "150"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 120
            while _steps_logged(steps) < 10 and run.poll() is None:
                assert time.monotonic() < deadline, "no training steps seen"
                time.sleep(0.2)
            trained = _steps_logged(steps)
            run.send_signal(signal.SIGTERM)
            rc = run.wait(timeout=90)
        finally:
            if run.poll() is None:
                run.kill()
    text = (tmp_path / "out.txt").read_text()
    assert rc == 128 + signal.SIGTERM, text[-3000:]
    assert "interrupted: the job saves and stops" in text, text[-3000:]
    assert "Phase: Stopped" in text, text[-3000:]
    saved = [c for c in checkpoints(f"file://{tmp_path}/ckpt") if c.committed]
    assert saved and saved[-1].step >= trained, (saved, trained, text[-2000:])
    assert not (tmp_path / "ckpt" / MARKER_NAME).exists()  # the root is free for the next run
    # nothing, torch's compile cache included (the run gives it a directory of its own)
    left = [p.name for p in tmpdir.iterdir()]
    assert not left, left
