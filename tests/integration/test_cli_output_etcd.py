"""The CLI's output against a real etcd: what the unit tests check over a stand-in."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from click.testing import CliRunner

from orchestrator.api import JobPhase
from orchestrator.cli import main
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.observe.records import PHASES
from orchestrator.state import keys, records
from orchestrator.state.records import JobStatus, LogChunk

pytestmark = pytest.mark.integration


def _job() -> str:
    return f"out-{uuid.uuid4().hex[:8]}"


def test_status_json_and_logs_of_an_unknown_node(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient
) -> None:
    job = _job()
    status = JobStatus(
        job,
        JobPhase.RUNNING,
        step=7,
        active_nodes=["node-a"],
        recoveries=1,
        last_recovery={
            "cause": "hang",
            "total_s": 1.0,
            "phases": {"detect": 0.4, "first_step": 0.1, "rendezvous": 0.3, "restore": 0.2},
        },
    )
    records.write(etcd_client, keys.job_status(job), status)
    chunk = LogChunk("node-b", 0, [(time.time(), "from a node that left")])
    records.write(etcd_client, keys.worker_logs(job, "node-b", 0) + "1", chunk)
    runner = CliRunner()

    out = runner.invoke(main, ["status", job, "--json", "--etcd", etcd.endpoint])
    assert out.exit_code == 0, out.output
    row = json.loads(out.output)
    assert row["name"] == job and row["step"] == 7 and row["recoveries"] == 1
    assert list(row["last_recovery"]["phases"]) == list(PHASES)

    table = runner.invoke(main, ["status", job, "--etcd", etcd.endpoint], env={"COLUMNS": "80"})
    assert "detect 0.40s, rendezvous 0.30s, restore 0.20s, first step 0.10s" in " ".join(
        line.split("│", 1)[-1].strip() for line in table.output.splitlines()
    )

    missing = runner.invoke(main, ["logs", job, "--node", "nonode", "--etcd", etcd.endpoint])
    assert missing.exit_code == 1
    assert f"job '{job}' has no node named 'nonode' (its nodes: node-a, node-b)" in (missing.output)
    left = runner.invoke(main, ["logs", job, "--node", "node-b", "--etcd", etcd.endpoint])
    assert left.exit_code == 0 and left.output == "[node-b/0] from a node that left\n"
