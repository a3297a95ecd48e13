"""``ringmaster plan`` end to end: a job file in, a plan, a PNG and an HTML page out;
``--from-run`` reads a job's recovery records from a real etcd."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.observe.records import RecoveryRecord
from orchestrator.state import events, keys, records
from orchestrator.state.records import JobPhase, JobStatus

JOB = "name: planned\nentrypoint: train.py\nnodes: {min: 4, max: 4, spares: 1}\n"


def _job_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    return path


def test_plan_prints_the_recommendation_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main,
        [
            "plan",
            str(_job_file(tmp_path)),
            "--nodes",
            "64",
            "--gpus-per-node",
            "8",
            "--days",
            "5",
            "--seeds",
            "1",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "job: 64 nodes x 8 GPUs (512 GPUs), nodes.min 64" in result.output
    assert "recommended spares: " in result.output
    assert "Young/Daly" in result.output
    for tier in ("torchrun", "torchft", "ringmaster-restart", "ringmaster-in-process"):
        assert f"  {tier} " in result.output
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"
    page = (out / "plan.html").read_text()
    assert page.count("<svg") == 3 and "ETTR" in page


def test_plan_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    job = _job_file(tmp_path)
    bad = CliRunner().invoke(main, ["plan", str(job), "--failure-model", "llama4"])
    assert bad.exit_code == 1
    assert "no preset of that name and no such file" in bad.output
    missing = CliRunner().invoke(main, ["plan", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "no such job file" in missing.output
    wide = CliRunner().invoke(main, ["plan", str(job), "--replica-nodes", "8"])
    assert wide.exit_code == 2 and "--replica-nodes 8 is more than the job's 4 nodes" in wide.output


def _record_run(client: EtcdClient, job: str) -> None:
    now = time.time()
    status = JobStatus(
        name=job,
        phase=JobPhase.SUCCEEDED,
        active_nodes=["n0", "n1"],
        spare_nodes=["n2"],
        submitted_at=now - 7200,
        train_started_at=now - 7200,
        finished_at=now + 1,  # after the NodeFailed event below
    )
    records.write(client, keys.job_status(job), status)
    for gen, (cause, node, t) in enumerate(
        [("agent_gone", "n3", now - 5000), ("hang", "n4", now - 2000)], start=2
    ):
        record = RecoveryRecord(gen, cause, [node], "why", t, t + 0.1, t + 0.3, t + 0.7, t + 1.0)
        records.write(client, keys.job_recovery(job, 1, gen), record)
    events.emit(client, job, "NodeFailed", "spare n5 lost", node="n5")


def test_plan_from_a_recorded_run(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job = f"recorded-{uuid.uuid4().hex[:8]}"
    _record_run(etcd_client, job)
    result = CliRunner().invoke(
        main,
        [
            "plan",
            str(_job_file(tmp_path)),
            "--from-run",
            job,
            "--etcd",
            etcd.endpoint,
            "--days",
            "2",
            "--seeds",
            "1",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert result.exit_code == 0, result.output
    # 3 nodes over 2 h: 0.25 node-days; two recoveries and a spare's NodeFailed
    assert f"from job {job}: 3 failed nodes in 0.250 node-days, 2 recoveries" in result.output
    assert "median detect 0.10s, rendezvous 0.20s, restore 0.40s, first_step 0.30s" in result.output
    assert f"failure model: from-run {job}" in result.output
    unknown = CliRunner().invoke(
        main, ["plan", str(_job_file(tmp_path)), "--from-run", "nobody", "--etcd", etcd.endpoint]
    )
    assert unknown.exit_code == 1 and "--from-run nobody: no job of that name" in unknown.output
