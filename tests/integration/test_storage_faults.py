"""Storage faults are storage faults, and a job's last words name its cause.

* A full disk (a small tmpfs, or a filesystem that raises ENOSPC where mounting
  is not allowed): every periodic save fails; each is a ``CheckpointFailed``
  event, training goes on without a restart, the failed saves' directories
  are removed, and the job succeeds.  With ``checkpoint.max_consecutive_failures``
  it fails by that rule instead, and its message names the storage fault
  without suggesting a resume that has nothing to resume from.
* A read-only ``checkpoint.url`` refuses ``ringmaster run`` before anything
  starts; submitted past that check, the workers' own probe fails the job with
  the storage's words, not with an expired lease.
* A script that fails before it reaches its loop ends the run with its error as
  the cause, and no resume advice (nothing was committed).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from orchestrator.api import JobPhase
from orchestrator.cli import main
from orchestrator.cli.job_commands import checkpoint_cell
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.process_lifetime import free_port
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs
from tests.chaos.jobs import REPO, quiet_run, summary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FULL_DISK = REPO / "tests" / "faults" / "full_disk.py"


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[bool]:
    """Mount a tmpfs at ``where`` (True), or leave it a plain directory (False)."""
    where.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError):
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _job(name: str, url: str, script: Path, **checkpoint: Any) -> Any:
    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(script),
                "args": ["--step-time", "0.02"],
                "env": {"RINGMASTER_LOG_EVERY": "1000"},
            },
            "nodes": {"min": 1, "max": 1, "spares": 0},
            "nproc_per_node": 2,
            "max_steps": 50,
            "checkpoint": {"url": url, "every_steps": 10, **checkpoint},
            "fault_tolerance": {
                "recovery": "in_process",
                "heartbeat_interval": "500ms",
                "max_restarts": 1,
            },
        }
    )


@pytest.mark.parametrize("limit", [0, 2], ids=["training-goes-on", "policy-fails-the-job"])
def test_a_full_disk_is_a_storage_fault(tmp_path: Path, etcd: EmbeddedEtcd, limit: int) -> None:
    disk = tmp_path / "disk"
    # two pages: the probe fits, no save of two ranks' shards and metadata does
    with tmpfs(disk, "size=8k") as mounted:
        script = REPO / "examples" / "train_tiny.py" if mounted else FULL_DISK
        url = f"file://{disk}/ckpt"
        spec = _job(f"full-disk-{limit}", url, script, max_consecutive_failures=limit)
        lines: list[str] = []
        options = EtcdOptions((etcd.endpoint,))
        with quiet_run(spec, lines, etcd=options, timeout=timedelta(seconds=90)) as run:
            result = run.wait()
        left = sorted(p.name for p in (disk / "ckpt").iterdir())
    failed = [e for e in result.events if e.type == "CheckpointFailed"]
    assert failed, summary(result, lines)
    first = failed[0]
    assert first.data["step"] == 10 and first.data["url"] == url, first
    assert "No space left on device" in first.data["cause"], first
    assert "\n" not in first.message and url in first.message, first
    assert not [e for e in result.events if e.type == "Restart"], summary(result, lines)
    assert result.recoveries == 0, summary(result, lines)
    assert not [n for n in left if n.startswith("step-")], left  # partial saves removed
    (end,) = [e.message for e in result.events if e.type == "Phase" and "Running" not in e.message]
    if limit == 0:
        assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
        assert [e.data["step"] for e in failed] == [10, 20, 30, 40, 50], failed
        assert "finished at step 50" in end, end
    else:
        assert result.phase is JobPhase.FAILED, summary(result, lines)
        # Rank 0 writes the CheckpointFailed events; every rank counts a failed save at
        # the same boundary, so rank 0 reports the second before the job fails for it
        assert [e.data["step"] for e in failed] == [10, 20], failed
        assert [e.data["consecutive"] for e in failed] == [1, 2], failed
        assert "checkpoint storage fault: 2 saves in a row" in end, end
        assert "save of step 20 to " in end, end
        assert "max_consecutive_failures is 2" in end and "No space left" in end, end
        assert "no checkpoint of this job" in end and "resume" not in end, end
        assert "an error in the training script" not in end, end


def _read_only(where: Path) -> contextlib.AbstractContextManager[bool]:
    """A directory this process cannot write: a read-only tmpfs as root, else mode 0o500."""
    if os.geteuid() == 0:
        return tmpfs(where, "ro,size=64k")
    where.mkdir()
    where.chmod(0o500)
    return contextlib.nullcontext(True)


def test_a_read_only_checkpoint_url_refuses_the_run_at_start(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    with _read_only(ro) as made:
        if not made:
            pytest.skip("no read-only directory can be made here (mount refused, as root)")
        job = tmp_path / "job.yaml"
        job.write_text(
            textwrap.dedent(f"""\
                name: read-only
                entrypoint: {{script: {REPO / "examples" / "train_tiny.py"}}}
                nodes: {{min: 1, max: 1}}
                max_steps: 5
                checkpoint: {{url: "file://{ro}/ckpt"}}
            """)
        )
        before = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
        result = CliRunner().invoke(main, ["run", str(job)])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert f"checkpoint.url file://{ro}/ckpt is not writable" in lines[0], lines
    assert "Read-only file system" in lines[0] or "Permission denied" in lines[0], lines
    assert "embedded etcd" not in result.output and "submitted" not in result.output
    started = set(os.listdir(os.environ.get("TMPDIR", "/tmp"))) - before
    assert not [n for n in started if "etcd" in n], started  # nothing was started


def test_a_read_only_checkpoint_url_seen_by_the_workers_fails_the_job_with_its_cause(
    tmp_path: Path, etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Submitted to a cluster (no check where the CLI runs): the controller, which holds
    the checkpoint root before any worker trains, finds it cannot write there (on
    machines where only the workers' mounts are read-only, their probe says it)."""
    ro = tmp_path / "ro"
    with _read_only(ro) as made:
        if not made:
            pytest.skip("no read-only directory can be made here (mount refused, as root)")
        monkeypatch.setattr(jobs, "check_checkpoint_url", lambda spec: None, raising=False)
        url = f"file://{ro}/ckpt"
        spec = _job("read-only-workers", url, REPO / "examples" / "train_tiny.py")
        lines: list[str] = []
        options = EtcdOptions((etcd.endpoint,))
        with quiet_run(spec, lines, etcd=options, timeout=timedelta(seconds=90)) as run:
            result = run.wait()
    assert result.phase is JobPhase.FAILED, summary(result, lines)
    (end,) = [e.message for e in result.events if e.type == "Phase" and "Failed" in e.message]
    assert f"checkpoint.url {url} cannot be written" in end, end
    assert "Read-only file system" in end and "another checkpoint.url" in end, end
    assert "resume" not in end, end
    assert not [e for e in result.events if e.type == "Restart"], summary(result, lines)
    assert not any("lease expired" in line for line in lines), summary(result, lines)


# It fails once its generation started: its node was warm, so the controller's
# "failed before their first step" ending (tests/chaos/test_job_cannot_go_on.py)
# cannot take this run, whichever worker fails first.
BROKEN_SCRIPT = """
from agents import runtime

session = runtime.init()
for step in session.steps(None):
    raise ValueError("learning_rate must be positive, got -1")
"""


def test_a_run_whose_agents_all_left_names_the_first_error(
    tmp_path: Path, etcd: EmbeddedEtcd
) -> None:
    script = tmp_path / "broken.py"
    script.write_text(BROKEN_SCRIPT)
    spec = _job("broken-script", f"file://{tmp_path}/ckpt", script)
    lines: list[str] = []
    options = EtcdOptions((etcd.endpoint,))
    with quiet_run(spec, lines, etcd=options, timeout=timedelta(seconds=90)) as run:
        result = run.wait()
    assert result.phase is JobPhase.FAILED, summary(result, lines)
    (last,) = [line for line in lines if line.startswith("[run] every node agent has exited")]
    assert "the first error: node-0-" in last, last
    assert "ValueError: learning_rate must be positive, got -1" in last, last
    assert "ringmaster resume" not in last and "committed no checkpoint" in last, last


@contextlib.contextmanager
def moto_process() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """moto's S3 server in a process of its own (so it can be SIGSTOPped), with a bucket."""
    import boto3

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                client.create_bucket(Bucket="hang")
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        yield proc, endpoint
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_hung_s3_endpoint_is_reported_and_the_job_still_ends(
    tmp_path: Path, etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto SIGSTOPped after the first commit: training goes on, ``status`` tells the save
    still uploading, and the job ends within ``checkpoint.final_wait`` of its last step,
    naming the newest durable checkpoint."""
    with moto_process() as (moto, endpoint):
        for name, value in {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(name, value)
        spec = _job(
            "s3-hang", "s3://hang/ckpt", REPO / "examples" / "train_tiny.py", final_wait="2s"
        )
        spec.max_steps = 250  # 4 s of training at least after the first commit: > final_wait
        lines: list[str] = []
        options = EtcdOptions((etcd.endpoint,))
        seen: list[str] = []
        with quiet_run(spec, lines, etcd=options, timeout=timedelta(seconds=120)) as run:
            deadline = time.monotonic() + 90
            while jobs.read_status(run.client, spec.name) is None or not (
                jobs.read_status(run.client, spec.name).last_checkpoint  # type: ignore[union-attr]
            ):
                assert time.monotonic() < deadline, summary(run.wait(), lines)
                time.sleep(0.1)
            os.kill(moto.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            while time.monotonic() - stopped < 60:
                status = jobs.read_status(run.client, spec.name)
                assert status is not None
                if status.phase.terminal:
                    break
                if status.uploading is not None:
                    seen.append(checkpoint_cell(status))
                time.sleep(0.2)
            result = run.wait()
            last_step_at = jobs.read_status(run.client, spec.name).last_step_at  # type: ignore[union-attr]
            finished_at = jobs.read_status(run.client, spec.name).finished_at  # type: ignore[union-attr]
    assert result.phase is JobPhase.SUCCEEDED and result.step == 250, summary(result, lines)
    assert any(re.search(r"step \d+ uploading for \d+ s", s) for s in seen), seen
    kinds = {e.type: e for e in result.events}
    assert "CheckpointStalled" in kinds, summary(result, lines)
    abandoned = kinds.get("CheckpointAbandoned")
    assert abandoned is not None, summary(result, lines)
    durable = abandoned.data["durable"]
    assert durable is not None and f"newest durable checkpoint is step {durable}" in (
        abandoned.message
    ), abandoned
    (end,) = [e.message for e in result.events if e.type == "Phase" and "Succeeded" in e.message]
    assert f"newest durable checkpoint is step {durable}" in end, end
    assert last_step_at is not None and finished_at is not None
    assert finished_at - last_step_at < 20, (last_step_at, finished_at)
