"""Worker output reaches etcd and `ringmaster logs` reads it back (real etcd, real processes)."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import uuid

import pytest
from click.testing import CliRunner

from agents.log_shipper import LogShipper
from orchestrator import keys, records
from orchestrator.api import JobPhase
from orchestrator.cli import main
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.observe.logs import follow_logs, read_logs

pytestmark = pytest.mark.integration


def job_name() -> str:
    return f"logs-{uuid.uuid4().hex[:8]}"


def ship(
    client: EtcdClient,
    job: str,
    node: str,
    local_rank: int,
    script: str,
    sink: io.BytesIO | None = None,
    **options: float,
) -> None:
    """Run ``script`` as a worker would run, its output going through a LogShipper."""
    with subprocess.Popen(
        [sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as proc:
        assert proc.stdout is not None
        shipper = LogShipper(client, job, node, local_rank, sink or io.BytesIO(), **options)
        shipper.start(proc.stdout)
        proc.wait()
        shipper.join()


def test_lines_are_teed_to_the_sink_and_stored_in_order(etcd_client: EtcdClient) -> None:
    job = job_name()
    sink = io.BytesIO()
    script = "import sys\nfor i in range(50): print(f'line {i}')\nprint('oops', file=sys.stderr)"
    ship(etcd_client, job, "node-a", 0, script, sink, flush_every=0.05)
    expected = [f"line {i}" for i in range(50)] + ["oops"]
    assert sink.getvalue().decode().splitlines() == expected
    lines = read_logs(etcd_client, job)
    assert [line.text for line in lines] == expected
    assert {line.worker for line in lines} == {"node-a/0"}
    assert [line.text for line in read_logs(etcd_client, job, tail=3)] == expected[-3:]
    assert read_logs(etcd_client, job, node="node-b") == []


def test_old_chunks_are_dropped_beyond_the_byte_budget(etcd_client: EtcdClient) -> None:
    job = job_name()
    script = "import time\nfor i in range(20):\n    print(f'chunk {i} ' + 'x' * 300)\n"
    script += "    time.sleep(0.03)"
    ship(etcd_client, job, "node-a", 0, script, flush_every=0.01, keep_bytes=1500)
    stored = etcd_client.get_prefix(keys.job_logs(job))
    assert 1 <= len(stored) < 20
    assert sum(len(kv.value) for kv in stored) <= 1500 + 400 * 5
    texts = [line.text for line in read_logs(etcd_client, job)]
    assert texts[-1].startswith("chunk 19 ")  # the newest output is always kept
    assert not any(t.startswith("chunk 0 ") for t in texts)


def test_follow_yields_stored_then_new_lines(etcd_client: EtcdClient) -> None:
    job = job_name()
    ship(etcd_client, job, "n1", 0, "print('before')", flush_every=0.01)
    stop = threading.Event()
    seen: list[str] = []

    def consume() -> None:
        for line in follow_logs(etcd_client, job, stop):
            seen.append(f"{line.worker} {line.text}")
            if len(seen) == 2:
                stop.set()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    ship(etcd_client, job, "n2", 1, "print('after')", flush_every=0.01)
    reader.join(timeout=10)
    assert seen == ["n1/0 before", "n2/1 after"]


def test_logs_command(etcd: EmbeddedEtcd, etcd_client: EtcdClient) -> None:
    runner = CliRunner()
    missing = runner.invoke(main, ["logs", "no-such-job", "--etcd", etcd.endpoint])
    assert missing.exit_code == 1 and "no job named 'no-such-job'" in missing.output

    job = job_name()
    records.write(etcd_client, keys.job_status(job), records.JobStatus(job, JobPhase.RUNNING))
    ship(etcd_client, job, "node-x", 2, "print('hello from a worker')", flush_every=0.01)
    out = runner.invoke(main, ["logs", job, "--etcd", etcd.endpoint, "-t"])
    assert out.exit_code == 0, out.output
    assert out.output.rstrip().endswith("[node-x/2] hello from a worker")
