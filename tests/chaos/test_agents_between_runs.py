"""Agents started between two runs of a job join the next run, on one long-lived controller.

A private etcd and one ``ringmaster controller`` that serves every job for
the whole test (as a long-lived service does); agents are real ``ringmaster
agent`` processes.  An agent may start while the job's last run is over (a
pod restarted, a person starting agents before typing ``resume``): it must
say that it waits for the next run, write nothing, and train in that run once
it starts.  Before, it registered into the ended run's plan, failed to form
its group, and the next run stayed Pending ("waiting for nodes: 0 ready").

1. in-process tier (`make test`): run 1 trains and is stopped; two agents start, then
   ``resume`` starts run 2, which those agents finish (``Succeeded``);
2. restart tier (`make chaos`): run 1 fails (the script exits 3, no restarts); two agents
   start, then the job is submitted again (run 2, the script now succeeds),
   which those agents finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs, keys
from orchestrator.state.records import JobStatus
from tests.chaos.jobs import tiny_job
from tests.faults.processes import Services

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]

NODES = ("node-a", "node-b")


def _tail(lines: list[str], n: int = 60) -> str:
    return "\n".join(lines[-n:])


def _wait(what: str, check: Callable[[], bool], lines: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{_tail(lines)}")
        time.sleep(0.05)


def _status(client: EtcdClient, job: str) -> JobStatus:
    status = jobs.read_status(client, job)
    assert status is not None, f"job {job} has no status"
    return status


def _start_agents(services: Services, job: str, endpoint: str, tag: str) -> list[str]:
    names = []
    for node in NODES:
        name = f"{job}.{node}.{tag}"
        args = ["agent", "--job", job, "--node", node, "--labels", f"host={node}"]
        services.start(name, [*args, "--etcd", endpoint])
        names.append(name)
    return names


def _exited(services: Services, names: list[str]) -> bool:
    return all(services.procs[n].poll() is not None for n in names)


def _of(lines: list[str], names: list[str]) -> str:
    return "\n".join(x for x in lines if any(x.startswith(f"[{n}] ") for n in names))


def _agents_wait_for_the_next_run(
    client: EtcdClient, services: Services, job: str, endpoint: str, lines: list[str]
) -> list[str]:
    """Start agents while the job's last run is over; they wait and write nothing."""
    ended = _status(client, job)
    assert ended.phase.terminal, ended
    names = _start_agents(services, job, endpoint, f"after-run{ended.run}")
    waiting = f"waiting for the next run of job '{job}' (its run {ended.run} is "

    def all_wait() -> bool:
        return all(waiting in _of(lines, [n]) for n in names)

    _wait("the new agents to wait for the next run", all_wait, lines, 60)
    assert client.get_prefix(keys.job_nodes(job)) == [], "an agent registered into an ended run"
    assert not any(services.procs[n].poll() is not None for n in names), _tail(lines)
    return names


def _next_run_ends(
    client: EtcdClient, services: Services, job: str, run: int, names: list[str], lines: list[str]
) -> JobStatus:
    """Wait for run ``run`` to end and its agents (``names``) to leave by themselves."""

    def ended() -> bool:
        status = _status(client, job)
        return status.run == run and status.phase.terminal

    _wait(f"run {run} of {job} to end", ended, lines, 120)
    _wait(f"run {run}'s agents to leave", lambda: _exited(services, names), lines, 30)
    return _status(client, job)


@pytest.mark.parametrize("tier", ["in_process", pytest.param("restart", marks=pytest.mark.long)])
def test_agents_started_between_runs_train_in_the_next_run(tmp_path: Path, tier: str) -> None:
    """The agents' wait for the next run is the same code in both tiers: ``make test``
    runs the in-process one, ``make chaos`` both."""
    lines: list[str] = []
    with (
        EmbeddedEtcd() as etcd,
        Services(lines) as services,
        connect(EtcdOptions((etcd.endpoint,))) as client,
    ):
        endpoint = etcd.endpoint
        controller = services.start("controller", ["controller", "--etcd", endpoint])
        if tier == "in_process":
            _in_process(client, services, endpoint, tmp_path, lines)
        else:
            _restart(client, services, endpoint, tmp_path, lines)
        assert controller.poll() is None, f"the controller exited\n{_tail(lines)}"


def _in_process(
    client: EtcdClient, services: Services, endpoint: str, tmp_path: Path, lines: list[str]
) -> None:
    """Stop run 1, agents start, resume: they finish run 2."""
    spec = tiny_job("between", tmp_path, steps=80, step_time=0.04, spares=0)
    job = spec.name
    assert jobs.submit(client, spec) == 1
    first = _start_agents(services, job, endpoint, "run1")
    _wait("run 1 at step 20", lambda: _status(client, job).step >= 20, lines)
    jobs.request_stop(client, job)
    stopped = _next_run_ends(client, services, job, 1, first, lines)
    assert stopped.phase is JobPhase.STOPPED, f"{stopped}\n{_tail(lines)}"
    between = _agents_wait_for_the_next_run(client, services, job, endpoint, lines)
    request = jobs.resume(client, job)
    assert request.step <= stopped.step, (request, stopped)
    finished = _next_run_ends(client, services, job, 2, between, lines)
    text = _of(lines, between)
    assert finished.phase is JobPhase.SUCCEEDED, f"{finished}\n{_tail(lines)}"
    assert finished.step == 80, f"{finished}\n{text}"
    assert text.count(f"run 2 of job '{job}' submitted after") == len(between), text
    assert "fenced out" not in text and "no longer current" not in text, text


def _restart(
    client: EtcdClient, services: Services, endpoint: str, tmp_path: Path, lines: list[str]
) -> None:
    """Run 1 fails, agents start, the job is submitted again: they finish run 2."""
    flag = tmp_path / "fail-now"
    flag.touch()
    script = tmp_path / "flagged.py"
    script.write_text(
        "import pathlib, sys\n"
        "import torch.distributed as dist\n"
        f"if pathlib.Path({str(flag)!r}).exists():\n"
        "    sys.exit(3)\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    restart = load_job_data(
        {
            "name": "between-restart",
            "entrypoint": {"script": str(script)},
            "nodes": {"min": 2, "max": 2, "spares": 0},
            "checkpoint": {"url": f"file://{tmp_path}/restart-ckpt"},
            "fault_tolerance": {"recovery": "restart", "max_restarts": 0},
        }
    )
    job = restart.name
    assert jobs.submit(client, restart) == 1
    first = _start_agents(services, job, endpoint, "run1")
    failed = _next_run_ends(client, services, job, 1, first, lines)
    assert failed.phase is JobPhase.FAILED, f"{failed}\n{_tail(lines)}"
    between = _agents_wait_for_the_next_run(client, services, job, endpoint, lines)
    flag.unlink()
    assert jobs.submit(client, restart) == 2
    finished = _next_run_ends(client, services, job, 2, between, lines)
    assert finished.phase is JobPhase.SUCCEEDED, f"{finished}\n{_tail(lines)}"
