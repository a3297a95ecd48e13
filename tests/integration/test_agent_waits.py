"""An agent started before its job waits for it (real etcd, real agent processes).

The agent says it is waiting and registers once the job is submitted; SIGTERM
while it waits ends it at once (no preemption save) and leaves no key behind;
a wait limit that runs out ends it with exit code 2 and one line.  Agents log
their lifecycle (registered, active in generation N, leaving) one line each,
and remove their temporary directory on the way out.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from agents.node.descriptions import describe_role
from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs, keys
from orchestrator.state.records import Member, Plan
from tests.faults.processes import REPO, Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _job_name() -> str:
    return f"waits-{uuid.uuid4().hex[:8]}"


def _one_node_job(name: str, tmp: Path) -> JobSpec:
    """One node, one worker, a few steps of examples/train_tiny.py."""
    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(REPO / "examples" / "train_tiny.py"),
                "env": {"RINGMASTER_LOG_EVERY": "1000"},
            },
            "nodes": {"min": 1, "max": 1, "spares": 0},
            "max_steps": 5,
            "checkpoint": {"url": f"file://{tmp}/ckpt", "every_steps": 0},
            "fault_tolerance": {"heartbeat_interval": "500ms"},
        }
    )


def _wait_for(what: str, check: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _of(lines: list[str], name: str) -> list[str]:
    return [line for line in lines if line.startswith(f"[{name}] ")]


def _agent_args(etcd: EmbeddedEtcd, job: str, node: str, *extra: str) -> list[str]:
    return ["agent", "--job", job, "--node", node, "--etcd", etcd.endpoint, *extra]


def test_an_agent_waits_for_its_job_then_trains(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, tmp_path: Path
) -> None:
    spec = _one_node_job(_job_name(), tmp_path)
    lines: list[str] = []
    agent_tmp = tmp_path / "agent-tmp"
    agent_tmp.mkdir()
    with Services(lines) as services:
        agent = services.start(
            "node-a",
            _agent_args(etcd, spec.name, "node-a"),
            env={"TMPDIR": str(agent_tmp)},
        )
        _wait_for("the waiting line", lambda: any("waiting for job" in x for x in lines))
        jobs.submit(etcd_client, spec)
        services.start("controller", ["controller", "--job", spec.name, "--etcd", etcd.endpoint])
        assert agent.wait(60) == 0, "\n".join(lines)
        status = jobs.read_status(etcd_client, spec.name)
        assert status is not None and status.phase is JobPhase.SUCCEEDED, "\n".join(lines)
    own = "\n".join(_of(lines, "node-a"))
    assert f"waiting for job '{spec.name}' to be submitted" in own
    assert "ringmaster submit job.yaml" in own
    for line in (
        f"registered for job '{spec.name}'",
        "active in generation 1: rank 0 of 1",
        "leaving: workers finished (job Succeeded)",
    ):
        assert own.count(line) == 1, f"{line!r} once expected in:\n{own}"
    assert "Traceback" not in own
    assert not list(agent_tmp.glob("rm-node-a-*")), "the agent left its temporary directory"


def test_sigterm_while_waiting_ends_the_agent_and_writes_nothing(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient
) -> None:
    job = _job_name()
    lines: list[str] = []
    with Services(lines) as services:
        agent = services.start("ghost", _agent_args(etcd, job, "node-g"))
        _wait_for("the waiting line", lambda: any("waiting for job" in x for x in lines))
        sent = time.monotonic()
        services.signal("ghost", signal.SIGTERM)
        assert agent.wait(10) == 0, "\n".join(lines)
        assert time.monotonic() - sent < 5
    own = "\n".join(_of(lines, "ghost"))
    assert "preempt" not in own.lower()
    assert "Traceback" not in own
    assert f"leaving: SIGTERM while waiting for job '{job}'" in own
    assert etcd_client.get_prefix(keys.job_prefix(job)) == []


@pytest.mark.parametrize(
    ("extra", "env"),
    [(["--wait-for-job", "1"], {"RINGMASTER_JOB_WAIT": "30"}), ([], {"RINGMASTER_JOB_WAIT": "1"})],
    ids=["option", "knob"],
)
def test_a_wait_limit_that_runs_out_is_one_line_and_exit_code_2(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, extra: list[str], env: dict[str, str]
) -> None:
    job = _job_name()
    lines: list[str] = []
    with Services(lines) as services:
        agent = services.start("ghost", _agent_args(etcd, job, "node-g", *extra), env=env)
        assert agent.wait(30) == 2, "\n".join(lines)
    own = _of(lines, "ghost")
    errors = [x for x in own if "error" in x.lower()]
    assert errors == [
        f"[ghost] error: job '{job}' was not submitted within 1s: submit it "
        "(`ringmaster submit job.yaml`) and start the agent again, or let it wait longer "
        "(--wait-for-job SECONDS, 0 = forever; env RINGMASTER_JOB_WAIT)"
    ], "\n".join(own)
    assert "Traceback" not in "\n".join(own)
    assert etcd_client.get_prefix(keys.job_prefix(job)) == []


def test_the_role_line_names_the_generation_and_the_ranks() -> None:
    plan = Plan(3, [Member("a", 0, 2), Member("b", 2, 1)], spares=["c"])
    assert describe_role(plan, "a") == ("active 3", "active in generation 3: ranks 0-1 of 3")
    assert describe_role(plan, "b") == ("active 3", "active in generation 3: rank 2 of 3")
    role, line = describe_role(plan, "c")
    assert (role, line) == ("spare", "spare: generation 3 trains without this node")
    assert describe_role(Plan(4, [Member("a", 0, 2)]), "c")[0] == role  # no new line
