"""One live writer per checkpoint root, with real processes and real etcds.

* Two ``ringmaster run``s of one job at once (each with its embedded etcd, one
  checkpoint root), as two people or a retried script would: the second is
  refused before anything of it starts, in one line naming the first run, and
  the first trains on untouched to Succeeded, every checkpoint there its own.
* A marker left by a SIGKILLed run (its heartbeat an hour old) is taken over
  with a warning, and a run that ends removes its marker.
* Two runs that pass the check before start at the same moment are settled by
  the controller, which takes the root before the job's first plan: the loser's
  job fails with the same line and publishes no plan.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from checkpoint.catalog import checkpoints
from orchestrator.api import JobPhase
from orchestrator.checkpoint_root.writer_hold import MarkerStore
from orchestrator.checkpoint_root.writer_marker import MARKER_NAME, STALE_AFTER_S, WriterMarker
from orchestrator.controller.job import JobController
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import jobs, keys, records
from orchestrator.state.events import list_events
from orchestrator.state.records import Plan
from tests.faults.processes import REPO
from tests.integration.controller_jobs import register_nodes, two_node_job

pytestmark = pytest.mark.integration

OTHER_RUN = "one-writer@1764000000.000000"


def _job_file(tmp: Path, steps: int, step_time: float, hold_at: int | None = None) -> Path:
    """``hold_at``: every worker waits before that step until ``tmp/go`` exists."""
    (tmp / "steps").mkdir(exist_ok=True)
    script = REPO / "examples" / "train_tiny.py"
    hold = f", --hold-at, '{hold_at}', --go-file, {tmp / 'go'}" if hold_at is not None else ""
    path = tmp / "job.yaml"
    path.write_text(
        "name: one-writer\n"
        f"entrypoint: {{script: {script}, args: [--step-time, '{step_time}', "
        f"--step-log, {tmp / 'steps'}{hold}]}}\n"
        "nodes: {min: 1, max: 1}\n"
        f"max_steps: {steps}\n"
        f"checkpoint: {{url: 'file://{tmp}/ckpt', every_steps: 20, keep: 10}}\n"
    )
    return path


def _run(tmp: Path, out: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    env |= {"RINGMASTER_LOG_DIR": str(tmp / "logs"), "PYTHONPATH": str(REPO)}
    with (tmp / out).open("w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "run", "job.yaml", "--timeout", "150"],
            cwd=tmp,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )


def _steps_logged(directory: Path) -> int:
    return sum(len(f.read_text().splitlines()) for f in directory.iterdir() if f.is_file())


def _foreign_marker(heartbeat_at: float) -> WriterMarker:
    return WriterMarker(
        OTHER_RUN, "0123456789abcdef", "one-writer", 1, "box-b", 4242, "", heartbeat_at, 0.0
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_second_run_on_the_same_root_is_refused_and_the_first_is_untouched(
    tmp_path: Path,
) -> None:
    # the first run holds before step 30 (its save of step 20 begun) until the second is
    # refused: it is still training then, however long the second takes to start (0.1 s
    # steps: each async save uploads before the next is due, none skipped)
    _job_file(tmp_path, steps=60, step_time=0.1, hold_at=30)
    marker = tmp_path / "ckpt" / MARKER_NAME
    first = _run(tmp_path, "first.txt")
    try:
        deadline = time.monotonic() + 120
        while _steps_logged(tmp_path / "steps") < 5:
            assert first.poll() is None and time.monotonic() < deadline, (
                tmp_path / "first.txt"
            ).read_text()[-3000:]
            time.sleep(0.2)
        holder = WriterMarker.decode(marker.read_bytes())
        assert holder.job == "one-writer" and holder.run == 1

        second = _run(tmp_path, "second.txt")
        assert second.wait(timeout=60) == 1
        refused = (tmp_path / "second.txt").read_text().strip().splitlines()
        assert len(refused) == 1, refused
        line = refused[0]
        assert line.startswith(f"error: checkpoint.url file://{tmp_path}/ckpt is being written")
        for part in (holder.run_id, f"controller pid {holder.pid}", holder.etcd, "last heartbeat"):
            assert part in line, (part, line)
        assert "wait for it to end" in line and "another checkpoint.url" in line
        assert first.poll() is None  # the refusal touched nothing of the first run
        assert WriterMarker.decode(marker.read_bytes()).token == holder.token

        (tmp_path / "go").touch()
        assert first.wait(timeout=150) == 0, (tmp_path / "first.txt").read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    out = (tmp_path / "first.txt").read_text()
    assert "Phase: Succeeded" in out, out[-3000:]
    saved = checkpoints(f"file://{tmp_path}/ckpt")
    assert [c.step for c in saved] == [20, 40, 60]
    assert all(c.committed and c.manifest is not None for c in saved)
    assert {c.manifest.run_id for c in saved if c.manifest} == {holder.run_id}
    assert not marker.exists()  # released as the run ended


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stale_marker_is_taken_over_and_released_at_the_end(tmp_path: Path) -> None:
    _job_file(tmp_path, steps=20, step_time=0.0)
    marker = tmp_path / "ckpt" / MARKER_NAME
    marker.parent.mkdir()
    marker.write_bytes(_foreign_marker(time.time() - 3600).encode())  # a SIGKILLed run's
    run = _run(tmp_path, "out.txt")
    try:
        assert run.wait(timeout=150) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    out = (tmp_path / "out.txt").read_text()
    assert "CheckpointRootTakenOver: took over checkpoint.url" in out, out[-3000:]
    assert OTHER_RUN in out and "controller pid 4242 on host box-b" in out
    assert "Phase: Succeeded" in out
    assert not marker.exists()


def test_the_controller_takes_the_root_before_the_first_plan(etcd_client: EtcdClient) -> None:
    """Nodes are ready, so only the held root keeps the plan back."""
    live, stale = (f"writer-{x}-{uuid.uuid4().hex[:6]}" for x in "ab")
    for job, heartbeat in ((live, time.time()), (stale, time.time() - STALE_AFTER_S - 5)):
        spec = two_node_job(job)
        MarkerStore(spec.checkpoint.url).replace(_foreign_marker(heartbeat))
        jobs.submit(etcd_client, spec)
        register_nodes(etcd_client, job, ["n1", "n2"])

    refused = JobController(etcd_client, live)
    refused.tick()
    status = jobs.read_status(etcd_client, live)
    assert status is not None and status.phase is JobPhase.FAILED
    assert status.message.startswith("checkpoint.url memory://controller-tests/")
    assert OTHER_RUN in status.message and "last heartbeat" in status.message
    assert records.read(etcd_client, keys.job_plan(live), Plan) is None
    kept = MarkerStore(two_node_job(live).checkpoint.url).read()
    assert kept is not None and kept.token == _foreign_marker(0).token  # left as it was

    taker = JobController(etcd_client, stale)
    taker.tick()
    assert taker.status.phase is JobPhase.RUNNING
    assert records.read(etcd_client, keys.job_plan(stale), Plan) is not None
    held = MarkerStore(two_node_job(stale).checkpoint.url).read()
    assert held is not None and held.job == stale and held.pid == os.getpid()
    events = list_events(etcd_client, stale)
    taken = [e.message for e in events if e.type == "CheckpointRootTakenOver"]
    assert len(taken) == 1 and OTHER_RUN in taken[0]
    taker.close()
