"""One leader per job, whatever mix of per-job and cluster-wide controllers runs.

Real processes on a private etcd (a controller of every job would otherwise
take up the jobs other tests left in the shared one): ``ringmaster controller``
(every job) beside ``ringmaster controller --job J`` (as ``ringmaster run``
starts it).  Nodes are plain records written by the test, as agents would.
Exactly one of the two logs being the job's leader, the job finishes, and each
phase event is written once; when the leader dies, the other kind takes the
job over on the same key.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.state import events, jobs, keys, records
from orchestrator.state.records import DoneRecord, Plan
from tests.faults.partitioned_job import wait_for
from tests.faults.processes import Services
from tests.integration.controller_jobs import register_nodes, submit_two_node_job

pytestmark = pytest.mark.integration


def leading(lines: list[str], job: str) -> list[str]:
    """The lines in which a controller says it now leads ``job``."""
    return [line for line in lines if f"is now the leader of job {job}" in line]


def decided(lines: list[str], job: str, phase: str, other_than: str = "") -> str | None:
    """The first line in which a controller (not ``other_than``) logs ``job`` moving to
    ``phase``."""
    return next(
        (x for x in lines if f"[{job}] {phase}:" in x and not x.startswith(other_than or "\0")),
        None,
    )


def finish(client: EtcdClient, job: str) -> None:
    """Both nodes' workers finished their loop (as the runtime records it)."""
    plan = records.read(client, keys.job_plan(job), Plan)
    assert plan is not None
    for node in ("n1", "n2"):
        done = DoneRecord(step=5, generation=plan.generation, at=time.time())
        records.write(client, keys.job_done(job) + keys.worker_id(node, 0), done)


def phase_events(client: EtcdClient, job: str) -> list[str]:
    return [e.message for e in events.list_events(client, job) if e.type == "Phase"]


def test_a_cluster_wide_and_a_per_job_controller_lead_the_job_once(
    private_etcd: tuple[EmbeddedEtcd, EtcdClient],
) -> None:
    server, client = private_etcd
    job = f"one-{uuid.uuid4().hex[:8]}"
    submit_two_node_job(client, job)
    lines: list[str] = []
    with Services(lines) as services:
        services.start("every-job", ["controller", "--etcd", server.endpoint])
        services.start("per-job", ["controller", "--job", job, "--etcd", server.endpoint])
        wait_for("a leader of the job", lambda: leading(lines, job))
        register_nodes(client, job, ["n1", "n2"])
        wait_for("Running", lambda: records.read(client, keys.job_plan(job), Plan))
        finish(client, job)
        wait_for(
            "Succeeded",
            lambda: (s := jobs.read_status(client, job)) and s.phase is JobPhase.SUCCEEDED,
        )
        ended = wait_for("the leader's log of the end", lambda: decided(lines, job, "Succeeded"))
    # up to the end one controller led; after it the other may take the key (nothing to decide)
    lead = leading(lines[: lines.index(ended)], job)
    assert len(lead) == 1, "\n".join(lines)
    assert lead[0].split()[0] == ended.split()[0], (lead, ended)  # the leader decided it
    assert not decided(lines, job, "Running", other_than=ended.split()[0]), "\n".join(lines)
    phases = phase_events(client, job)
    assert sum(m.startswith("Running") for m in phases) == 1, phases
    assert sum(m.startswith("Succeeded") for m in phases) == 1, phases
    generations = [e for e in events.list_events(client, job) if e.type == "Generation"]
    assert len(generations) == 1, generations


@pytest.mark.parametrize("first", ["every-job", "per-job"])
def test_the_other_kind_of_controller_takes_the_job_over(
    private_etcd: tuple[EmbeddedEtcd, EtcdClient], first: str
) -> None:
    """The leader SIGKILLed mid-job: the other kind waits on the same key, then leads."""
    server, client = private_etcd
    job = f"over-{uuid.uuid4().hex[:8]}"
    submit_two_node_job(client, job)
    commands = {
        "every-job": ["controller", "--etcd", server.endpoint],
        "per-job": ["controller", "--job", job, "--etcd", server.endpoint],
    }
    second = next(name for name in commands if name != first)
    lines: list[str] = []
    with Services(lines) as services:
        services.start(first, commands[first])
        wait_for("the first leader", lambda: leading(lines, job))
        services.start(second, commands[second])
        register_nodes(client, job, ["n1", "n2"])
        wait_for("Running", lambda: records.read(client, keys.job_plan(job), Plan))
        assert all(line.startswith(f"[{first}]") for line in leading(lines, job)), lines
        services.signal(first, signal.SIGKILL)
        took_over = wait_for(
            "the second leader", lambda: [x for x in leading(lines, job) if f"[{second}]" in x]
        )
        assert len(took_over) == 1
        register_nodes(client, job, ["n1", "n2"])  # fresh beats for the new leader's look
        finish(client, job)
        wait_for(
            "Succeeded",
            lambda: (s := jobs.read_status(client, job)) and s.phase is JobPhase.SUCCEEDED,
        )
    phases = phase_events(client, job)
    assert sum(m.startswith("Running") for m in phases) == 1, phases
    assert sum(m.startswith("Succeeded") for m in phases) == 1, phases
