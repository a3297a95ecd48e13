"""Worker output stays on the node; `ringmaster logs` reads it through the agent, else etcd.

Real etcd, real worker processes, and the agent's real port serving the files
(:func:`agents.node.agent_port.open_port`, which asks the job's credential),
registered as a node agent registers it.
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from agents.node import log_files
from agents.node.agent_port import open_port
from agents.node.log_shipper import CUT, MAX_LINE, TAIL_BYTES, TAIL_LINES, LogShipper
from orchestrator.api import JobPhase
from orchestrator.cli import main
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.observe.log_follow import follow_logs
from orchestrator.observe.logs import LogLine, read_logs
from orchestrator.ports.liveness import LivenessServer
from orchestrator.spec.job import EntrypointSpec, JobSpec
from orchestrator.state import jobs, keys, records
from orchestrator.state.records import JobStatus
from tests.etcd_relay import Relay

pytestmark = pytest.mark.integration


def job_name() -> str:
    return f"logs-{uuid.uuid4().hex[:8]}"


def start(
    client: EtcdClient,
    job: str,
    node: str,
    local_rank: int,
    script: str,
    root: Path,
    sink: io.BytesIO | None = None,
    **options: int,
) -> tuple[subprocess.Popen[bytes], LogShipper]:
    """Start ``script`` as a worker would run, its output going through a LogShipper."""
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdout is not None
    log_dir = log_files.node_dir(root, job, node)
    shipper = LogShipper(
        client, job, node, local_rank, sink or io.BytesIO(), log_dir=log_dir, **options
    )
    return proc, shipper.start(proc.stdout)


def ship(
    client: EtcdClient,
    job: str,
    node: str,
    local_rank: int,
    script: str,
    root: Path,
    sink: io.BytesIO | None = None,
    **options: int,
) -> LogShipper:
    """Run ``script`` to its end (the tail is then in etcd)."""
    proc, shipper = start(client, job, node, local_rank, script, root, sink, **options)
    with proc:
        proc.wait()
        shipper.join()  # before the pipe is closed
    return shipper


@contextmanager
def agent(client: EtcdClient, job: str, node: str, root: Path) -> Iterator[LivenessServer]:
    """The node's agent port serving its log files (the job's credential asked, as the
    agent asks it), registered as the agent does."""
    with open_port(client, job, node, "127.0.0.1", dict, root) as server:
        record = records.NodeRecord(node, "127.0.0.1", 1, 1, [], time.time())
        record.liveness = server.address
        records.write(client, keys.job_node(job, node), record)
        yield server


def submitted(client: EtcdClient) -> str:
    job = job_name()
    records.write(client, keys.job_status(job), records.JobStatus(job, JobPhase.RUNNING))
    return job


def test_output_is_teed_filed_and_only_its_tail_stored_in_etcd(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job = job_name()
    sink = io.BytesIO()
    script = "import sys\nfor i in range(200): print(f'line {i}')\nprint('oops', file=sys.stderr)"
    ship(etcd_client, job, "node-a", 0, script, tmp_path, sink)
    expected = [f"line {i}" for i in range(200)] + ["oops"]
    assert sink.getvalue().decode().splitlines() == expected
    # the node's files hold everything, with times in order
    files = log_files.read_after(log_files.node_dir(tmp_path, job, "node-a") / "0", None, 1 << 20)
    assert [text for _, text in files.lines] == expected
    assert [t for t, _ in files.lines] == sorted(t for t, _ in files.lines)
    # etcd: one key for the worker, its last lines only
    stored = etcd_client.get_prefix(keys.job_logs(job))
    assert [kv.key for kv in stored] == [keys.worker_log_tail(job, "node-a", 0)]
    assert len(stored[0].value) <= TAIL_BYTES
    lines = read_logs(etcd_client, job)  # no agent registered: the tail from etcd
    assert [line.text for line in lines] == expected[-TAIL_LINES:]
    assert {line.worker for line in lines} == {"node-a/0"}
    assert [line.text for line in read_logs(etcd_client, job, tail=3)] == expected[-3:]
    assert read_logs(etcd_client, job, node="node-b") == []


def test_a_5_mib_line_is_cut_and_etcd_gets_a_bounded_tail(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job = job_name()
    sink = io.BytesIO()
    script = "import sys\nsys.stdout.write('y' * (5 << 20) + '\\n')\n"
    script += "for i in range(60): print('z' * 3000)\nprint('after')"
    ship(etcd_client, job, "node-a", 0, script, tmp_path, sink)
    assert len(sink.getvalue()) > 5 << 20  # stdout (the kubelet's log) gets every byte
    files = log_files.read_after(log_files.node_dir(tmp_path, job, "node-a") / "0", None, 1 << 20)
    texts = [text for _, text in files.lines]
    assert texts[0] == "y" * MAX_LINE + CUT and texts[-1] == "after" and len(texts) == 62
    (kv,) = etcd_client.get_prefix(keys.job_logs(job))
    assert len(kv.value) <= TAIL_BYTES
    tail = records.decode(records.LogChunk, kv.value, kv.key)
    assert tail.lines[-1][1] == "after" and len(tail.lines) >= 5


def test_logs_over_4_mib_are_read_through_the_agents(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job = submitted(etcd_client)
    lines_each = 12_000  # ~1.2 MiB per worker, 4.8 MiB in all: over gRPC's 4 MiB
    script = (
        "import sys\nsys.stdout.write(''.join("
        f"f'line {{i:05d}} ' + 'x' * 90 + '\\n' for i in range({lines_each})))"
    )
    runner = CliRunner()
    endpoint = ["--etcd", etcd.endpoint]
    with agent(etcd_client, job, "n1", tmp_path), agent(etcd_client, job, "n2", tmp_path) as n2:
        for node in ("n1", "n2"):
            for rank in (0, 1):
                ship(etcd_client, job, node, rank, script, tmp_path)
        out = runner.invoke(main, ["logs", job, *endpoint])
        assert out.exit_code == 0, out.output[-2000:]
        printed = out.output.splitlines()
        assert len(printed) == 4 * lines_each
        assert len(out.output) > 4 << 20
        for worker in ("n1/0", "n1/1", "n2/0", "n2/1"):
            mine = [p for p in printed if p.startswith(f"[{worker}] ")]
            assert [p.split()[2] for p in mine] == [f"{i:05d}" for i in range(lines_each)]
        last = runner.invoke(main, ["logs", job, "--node", "n2", "--tail", "3", *endpoint])
        assert last.exit_code == 0, last.output
        assert [p.split()[2] for p in last.output.splitlines()] == ["11997", "11998", "11999"]
        assert all(p.startswith("[n2/1] ") for p in last.output.splitlines())
        n2.close()  # the agent of n2 is gone (still registered: its port refuses)
        gone = runner.invoke(main, ["logs", job, "--node", "n2", *endpoint])
    assert gone.exit_code == 0, gone.output
    assert "note: n2: the agent at" in gone.output and "kept in etcd" in gone.output
    shown = [p for p in gone.output.splitlines() if p.startswith("[")]
    assert len(shown) == 2 * TAIL_LINES  # the tail each worker left at its exit
    assert shown[-1].startswith("[n2/1] line 11999 ")


def test_follow_reads_new_lines_from_the_agent_and_tails_from_etcd(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job = submitted(etcd_client)
    go = tmp_path / "go"
    script = (
        "import os, time\nprint('before')\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\nprint('after')"
    )
    seen: list[str] = []
    stop = threading.Event()
    with agent(etcd_client, job, "n1", tmp_path):
        proc, shipper = start(etcd_client, job, "n1", 0, script, tmp_path)
        deadline = time.monotonic() + 10
        while not log_files.extent(tmp_path / job / "n1" / "0")[1] and time.monotonic() < deadline:
            time.sleep(0.02)  # 'before' is on file

        def consume() -> None:
            for line in follow_logs(etcd_client, job, stop, poll=0.05):
                seen.append(f"{line.worker} {line.text}")
                if len(seen) == 3:
                    stop.set()

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        time.sleep(0.3)
        go.touch()  # the agent's worker prints on
        proc.wait(timeout=10)
        shipper.join()
        # a worker of a node without an agent: its tail reaches etcd as it exits
        ship(etcd_client, job, "n2", 1, "print('from a node that left')", tmp_path)
        reader.join(timeout=15)
        proc.stdout.close()  # type: ignore[union-attr]
    assert seen[0] == "n1/0 before"
    assert sorted(seen[1:]) == ["n1/0 after", "n2/1 from a node that left"]


def test_logs_command(etcd: EmbeddedEtcd, etcd_client: EtcdClient, tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(main, ["logs", "no-such-job", "--etcd", etcd.endpoint])
    assert missing.exit_code == 1 and "no job named 'no-such-job'" in missing.output

    job = submitted(etcd_client)
    ship(etcd_client, job, "node-x", 2, "print('hello from a worker')", tmp_path)
    out = runner.invoke(main, ["logs", job, "--etcd", etcd.endpoint, "-t"])
    assert out.exit_code == 0, out.output
    assert out.output.rstrip().endswith("[node-x/2] hello from a worker")
    # --follow shows the run going on: an ended run is refused, not read once in silence
    spec = JobSpec(name=job, entrypoint=EntrypointSpec(script="train.py")).validate()
    assert jobs.submit(etcd_client, spec, replace_finished=True) == 1
    records.write(etcd_client, keys.job_status(job), JobStatus(job, phase=JobPhase.STOPPED))
    assert jobs.submit(etcd_client, spec) == 2
    ended = runner.invoke(main, ["logs", job, "--etcd", etcd.endpoint, "--follow", "--run", "1"])
    assert ended.exit_code == 2, ended.output
    assert "run 1 has ended: drop --follow" in ended.output, ended.output


def test_follow_from_a_time_shows_only_what_was_written_since(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    """``since`` (``logs --follow --run N``: the run's start) cuts before ``tail``."""
    job = submitted(etcd_client)
    ship(etcd_client, job, "n1", 0, "print('old')", tmp_path)
    since = time.time()
    ship(etcd_client, job, "n2", 0, "print('new')", tmp_path)
    stop = threading.Event()
    stop.set()  # the lines so far, then nothing more
    got = [line.text for line in follow_logs(etcd_client, job, stop, tail=5, since=since)]
    assert got == ["new"], got
    stop = threading.Event()
    stop.set()
    every = [line.text for line in follow_logs(etcd_client, job, stop, tail=5)]
    assert every == ["old", "new"], every


class Followed:
    """What ``follow_logs`` yielded and noted, with waits on it."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.notes: list[str] = []
        self._cond = threading.Condition()

    def line(self, line: LogLine) -> None:
        with self._cond:
            self.lines.append(f"{line.worker} {line.text}")
            self._cond.notify_all()

    def note(self, text: str) -> None:
        with self._cond:
            self.notes.append(text)
            self._cond.notify_all()

    def wait_for(self, done: Callable[[], bool]) -> None:
        with self._cond:
            assert self._cond.wait_for(done, 30), (self.lines, self.notes)


def test_follow_resumes_a_lost_watch_without_missing_or_repeating_a_line(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient
) -> None:
    """The follower's etcd connection goes through a relay; cutting it loses the watch."""
    job = submitted(etcd_client)
    kept: dict[str, list[tuple[float, str]]] = {}

    def exited(node: str, *texts: str) -> int:
        """A worker of ``node`` printed ``texts``: its tail (all it printed) goes to etcd."""
        kept.setdefault(node, []).extend((time.time(), t) for t in texts)
        key = keys.worker_log_tail(job, node, 0)
        records.write(etcd_client, key, records.LogChunk(node, 0, list(kept[node])))
        kv = etcd_client.get(key)
        assert kv is not None
        return kv.mod_revision

    relay = Relay(etcd.endpoint)
    client = connect(EtcdOptions((relay.endpoint,), op_timeout=timedelta(seconds=2)))
    seen = Followed()
    stop = threading.Event()

    def consume() -> None:
        for line in follow_logs(client, job, stop, poll=0.05, notes=seen.note):
            seen.line(line)

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        last = exited("n1", "a0")
        seen.wait_for(lambda: len(seen.lines) == 1)
        relay.cut()  # the watch is lost; tails go on reaching etcd
        seen.wait_for(lambda: bool(seen.notes))
        exited("n1", "a1")  # the same worker's tail again, with its earlier line
        exited("n2", "b0")
        exited("n1", "a2")
        relay.restore()
        seen.wait_for(lambda: len(seen.lines) == 4)
        exited("n3", "c0")  # and the renewed watch goes on
        seen.wait_for(lambda: len(seen.lines) == 5)
    finally:
        stop.set()
        reader.join(30)
        client.close()
        relay.close()
    assert not reader.is_alive()
    assert sorted(seen.lines) == ["n1/0 a0", "n1/0 a1", "n1/0 a2", "n2/0 b0", "n3/0 c0"]
    assert seen.lines.index("n1/0 a1") < seen.lines.index("n1/0 a2")
    # one line for the loss, saying that it resumes where it was
    (note,) = seen.notes
    assert f"etcd watch of {keys.job_logs(job)} was lost (" in note, note
    assert note.endswith(f"resuming from revision {last + 1}"), note
