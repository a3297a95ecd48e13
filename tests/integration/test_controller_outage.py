"""The controller across a real etcd quorum loss: pause, grace, then detection again.

A :class:`~orchestrator.controller.job.JobController` runs a job on a real
three-member cluster; nodes are plain registrations and heartbeats written
by the test (no training processes).  Two members are killed and restarted:
the controller's next look marks the job ``Paused`` with the reason, and a
registration missing right after the outage is not taken as a dead node
until the grace has passed; then it is.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest

from orchestrator.api import JobPhase
from orchestrator.controller import policy
from orchestrator.controller.job import JobController
from orchestrator.etcd.client import connect
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.state import events, jobs, keys, records
from orchestrator.state.records import Plan
from tests.faults.etcd_cluster import EtcdCluster
from tests.integration.controller_jobs import register_nodes, submit_two_node_job

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


def test_no_failure_is_declared_until_a_grace_after_the_outage(
    cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(policy, "OUTAGE_GRACE", timedelta(seconds=1.5))
    job = f"outage-{uuid.uuid4().hex[:8]}"
    client = connect(EtcdOptions(cluster.endpoints, op_timeout=timedelta(seconds=1)))
    submit_two_node_job(client, job)
    register_nodes(client, job, ["n1", "n2"])
    jc = JobController(client, job)
    jc.tick()
    assert jc.status.phase is JobPhase.RUNNING

    cluster.kill(0)
    cluster.kill(1)
    with pytest.raises(Exception, match="without quorum"):
        jc.tick()
    time.sleep(2.5)
    cluster.restart(0)
    cluster.restart(1)
    cluster.wait_healthy()
    # n2's registration expired while etcd had no quorum (deleted here to say so)
    retry_unavailable(lambda: client.delete(keys.job_node(job, "n2")), "delete")
    retry_unavailable(lambda: register_nodes(client, job, ["n1"]), "beat")
    retry_unavailable(jc.tick, "tick")
    status = jobs.read_status(client, job)
    assert status is not None and status.phase is JobPhase.PAUSED
    assert "etcd was unavailable" in status.message and "No failures" in status.message
    plan = records.read(client, keys.job_plan(job), Plan)
    assert plan is not None and plan.generation == 1
    assert not [e for e in events.list_events(client, job) if e.type == "NodeFailed"]

    deadline = time.monotonic() + 10
    while jc.status.phase is JobPhase.PAUSED:
        assert time.monotonic() < deadline, "the job never left the pause"
        # the restarted members may still be settling: an etcd hiccup is retried
        retry_unavailable(lambda: register_nodes(client, job, ["n1"]), "beat")
        retry_unavailable(jc.tick, "tick")
        time.sleep(0.2)
    # after the grace the missing registration counts (no spare: the job waits for one)
    assert jc.status.phase is JobPhase.RECOVERING, jc.status
    assert "lease expired: n2" in jc.status.message, jc.status.message
    client.close()
