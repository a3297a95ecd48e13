"""The node agent against a job that asks for more workers than its node can run.

Real agents (``ringmaster agent`` processes) on a private etcd; the workers
run a tiny script that records its pid and sleeps (in-process tier, no torch).

* ``nproc_per_node`` over the node's CPUs is refused with one line before any
  worker starts or the node registers, and the job's events say why;
  ``oversubscribe: true`` in the job file starts them anyway;
* SIGTERM while the agent starts its workers stops the starting at once.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from agents.node.capacity import usable_cpus
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.spec.loader import load_job_data
from orchestrator.state import events, jobs, keys
from tests.faults.processes import Services

pytestmark = pytest.mark.integration

#: A worker: say it started (a file named by its pid), then wait to be stopped.
SCRIPT = """\
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], str(os.getpid())).touch()
time.sleep(120)
"""


def _wait(what: str, check: Callable[[], object], lines: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + "\n".join(lines)
        time.sleep(0.05)


def _submit(client: EtcdClient, tmp: Path, nproc: int, oversubscribe: bool) -> tuple[str, Path]:
    job = f"cap-{uuid.uuid4().hex[:6]}"
    started = tmp / "started"
    started.mkdir()
    script = tmp / "worker.py"
    script.write_text(SCRIPT)
    spec = load_job_data(
        {
            "name": job,
            "entrypoint": {"script": str(script), "args": [str(started)]},
            "nproc_per_node": nproc,
            "oversubscribe": oversubscribe,
            "fault_tolerance": {"recovery": "in_process"},
        }
    )
    jobs.submit(client, spec)
    return job, started


def _agent(services: Services, endpoint: str, job: str, tmp: Path) -> None:
    args = ["agent", "--job", job, "--node", "n1", "--etcd", endpoint]
    services.start("n1", args, cwd=tmp)


def test_more_workers_than_cpus_are_refused_with_one_line(
    private_etcd: tuple[EmbeddedEtcd, EtcdClient], tmp_path: Path
) -> None:
    server, client = private_etcd
    cpus = usable_cpus()
    job, started = _submit(client, tmp_path, cpus + 1, oversubscribe=False)
    lines: list[str] = []
    with Services(lines) as services:
        _agent(services, server.endpoint, job, tmp_path)
        assert services.procs["n1"].wait(60) == 2
    errors = [line for line in lines if "error:" in line]
    assert errors == [
        f"[n1] error: node n1: nproc_per_node ({cpus + 1}) is more than the {cpus} "
        f"CPU{'s' if cpus != 1 else ''} it may use: set nproc_per_node to at most {cpus}, "
        "or `oversubscribe: true` in the job file to start them anyway"
    ], lines
    assert not any("Traceback" in line for line in lines), lines
    assert not list(started.iterdir())  # no worker was started
    assert client.get(keys.job_node(job, "n1")) is None  # nor the node registered
    refused = [e for e in events.list_events(client, job) if e.type == "NodeRefused"]
    assert len(refused) == 1 and f"at most {cpus}" in refused[0].message


def test_oversubscribe_starts_them_anyway(
    private_etcd: tuple[EmbeddedEtcd, EtcdClient], tmp_path: Path
) -> None:
    server, client = private_etcd
    nproc = usable_cpus() + 1
    job, started = _submit(client, tmp_path, nproc, oversubscribe=True)
    lines: list[str] = []
    with Services(lines) as services:
        _agent(services, server.endpoint, job, tmp_path)
        _wait("every worker", lambda: len(list(started.iterdir())) == nproc, lines)
        _wait("the registration", lambda: client.get(keys.job_node(job, "n1")), lines)
    assert not [e for e in events.list_events(client, job) if e.type == "NodeRefused"]


def test_sigterm_stops_the_agent_starting_workers_at_once(
    private_etcd: tuple[EmbeddedEtcd, EtcdClient], tmp_path: Path
) -> None:
    server, client = private_etcd
    nproc = 64
    job, started = _submit(client, tmp_path, nproc, oversubscribe=True)
    lines: list[str] = []
    with Services(lines) as services:
        _agent(services, server.endpoint, job, tmp_path)
        _wait("the first worker", lambda: list(started.iterdir()), lines)
        services.signal("n1", signal.SIGTERM)
        sent = time.monotonic()
        assert services.procs["n1"].wait(30) == 0
        took = time.monotonic() - sent
    count = len(list(started.iterdir()))
    assert count < nproc, f"all {nproc} workers were started after the SIGTERM"
    assert took < 10, f"the agent took {took:.1f}s to leave"
    assert any("leaving: SIGTERM while starting its workers" in line for line in lines), lines
    assert client.get(keys.job_node(job, "n1")) is None  # never registered
