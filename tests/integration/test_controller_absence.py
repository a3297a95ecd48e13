"""While no controller leads a job: ``status`` says so, and a leader back catches up.

Real etcd; controllers run in-process (:class:`~orchestrator.controller.job.JobController`
ticked by the test, or the :class:`~orchestrator.controller.service.Controller`
service in a thread); nodes are registrations and beats written by the test as
agents write them, a spare's under a lease that is left to expire (its agent
SIGKILLed); checkpoint commits go through the runtime's own
:func:`~agents.runtime.commit_record.record_commit`, fenced on the plan.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
from click.testing import CliRunner

from agents.runtime.commit_record import record_commit
from orchestrator.api import JobPhase
from orchestrator.cli import main
from orchestrator.controller.job import JobController
from orchestrator.controller.service import Controller
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.state import events, jobs, keys, records
from orchestrator.state.fencing import GenerationFence
from orchestrator.state.records import CheckpointRecord, NodeRecord, Plan, ProgressRecord
from tests.integration.controller_jobs import register_nodes, submit_two_node_job

pytestmark = pytest.mark.integration


def wait_for(what: str, check: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def status_output(etcd: EmbeddedEtcd, job: str) -> tuple[str, str]:
    result = CliRunner().invoke(
        main, ["status", job, "--etcd", etcd.endpoint], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 0, result.output
    return result.stdout, result.stderr


def test_status_says_when_no_controller_has_led_the_job(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs, "UNDECIDED_AFTER_S", 1.0)  # "a few seconds", made short
    job = f"absent-{uuid.uuid4().hex[:8]}"
    submit_two_node_job(etcd_client, job)
    register_nodes(etcd_client, job, ["n1", "n2"])
    stop = threading.Event()
    controller = Controller(etcd_client, job=job)
    thread = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for("Running", lambda: (s := jobs.read_status(etcd_client, job)) and s.step == 5)
        time.sleep(1.5)  # longer than the threshold: a leader keeps the status fresh
        out, err = status_output(etcd, job)
        assert "no controller" not in out + err and "undecided" not in out
    finally:
        stop.set()
        thread.join(10)
    assert etcd_client.get(keys.controller_leader(job)) is None

    def says_undecided() -> bool:
        return "no controller has led this job for" in status_output(etcd, job)[1]

    wait_for("the status to say nobody decides", says_undecided, timeout=10)
    out, err = status_output(etcd, job)
    assert f"warning: job {job}: no controller has led this job for" in err
    assert f"start `ringmaster controller --etcd {etcd.endpoint}`" in err
    assert "Running, undecided: no controller has led this job for" in " ".join(out.split())
    listing = CliRunner().invoke(main, ["status", "--etcd", etcd.endpoint])
    assert "Running, undecided" in listing.stdout and job in listing.stderr


def test_a_submitted_job_no_controller_ever_led_is_undecided(etcd_client: EtcdClient) -> None:
    job = f"never-{uuid.uuid4().hex[:8]}"
    submit_two_node_job(etcd_client, job)
    status = jobs.read_status(etcd_client, job)
    assert status is not None and status.led_at == status.submitted_at > 0
    assert jobs.undecided(etcd_client, [status]) == {}  # just submitted
    later = status.led_at + jobs.UNDECIDED_AFTER_S + 37
    assert jobs.undecided_for(status, None, later) == pytest.approx(jobs.UNDECIDED_AFTER_S + 37)
    assert jobs.undecided_for(status, "host-1", later) is None  # one leads it


def _commit(client: EtcdClient, fence: GenerationFence, job: str, step: int) -> None:
    record = CheckpointRecord(url="file:///ck", step=step, reason="periodic", at=time.time())
    record_commit(fence, job, record)


def _checkpoint_events(client: EtcdClient, job: str) -> list[tuple[int, bool]]:
    """(step, written late) of each Checkpoint event."""
    return [
        (int(e.data["step"]), "while no controller led" in e.message)
        for e in events.list_events(client, job)
        if e.type == "Checkpoint" and "step" in e.data
    ]


def test_checkpoints_committed_while_no_controller_led_get_their_events(
    etcd_client: EtcdClient,
) -> None:
    job = f"catchup-{uuid.uuid4().hex[:8]}"
    submit_two_node_job(etcd_client, job)
    register_nodes(etcd_client, job, ["n1", "n2"])
    first = JobController(etcd_client, job)
    first.tick()
    assert first.status.phase is JobPhase.RUNNING
    plan = etcd_client.get(keys.job_plan(job))
    assert plan is not None
    fence = GenerationFence(etcd_client, job)
    fence.join(1, plan.mod_revision)  # rank 0 of generation 1
    _commit(etcd_client, fence, job, 10)
    register_nodes(etcd_client, job, ["n1", "n2"])
    first.tick()
    assert _checkpoint_events(etcd_client, job) == [(10, False)]

    # the controller dies; three commits are made while none leads
    for step in (20, 30, 40):
        _commit(etcd_client, fence, job, step)
    kept = records.read(etcd_client, keys.job_checkpoint(job), CheckpointRecord)
    assert kept is not None and kept.step == 40
    assert [c.step for c in kept.earlier] == [10, 20, 30]

    register_nodes(etcd_client, job, ["n1", "n2"])
    back = JobController(etcd_client, job)  # a standby takes over, reading etcd
    back.tick()
    back.tick()
    assert _checkpoint_events(etcd_client, job) == [
        (10, False),
        (20, True),
        (30, True),
        (40, False),
    ]
    status = jobs.read_status(etcd_client, job)
    assert status is not None and status.last_checkpoint == "step 40 (periodic)"


def _register_spare(client: EtcdClient, job: str, node: str, ttl: int) -> None:
    """A spare's registration under a lease nobody keeps alive (its agent is gone)."""
    now = time.time()
    lease = client.lease(ttl)
    registration = NodeRecord(node, "127.0.0.1", 1, 7, [7], now, labels={"host": node})
    client.put(keys.job_node(job, node), registration.encode(), lease=lease)
    beat = ProgressRecord(0, 0, -1, 0, 7, now, now)
    records.write(client, keys.job_progress(job) + keys.worker_id(node, 0), beat)


def _lost(client: EtcdClient, job: str) -> list[str]:
    return [e.data.get("node", "") for e in events.list_events(client, job) if e.type == "NodeLost"]


@pytest.mark.parametrize("leader", ["live", "taking over"])
def test_a_lost_spare_is_a_node_lost_event(etcd_client: EtcdClient, leader: str) -> None:
    job = f"spare-{uuid.uuid4().hex[:8]}"
    submit_two_node_job(etcd_client, job)
    register_nodes(etcd_client, job, ["n1", "n2"])
    _register_spare(etcd_client, job, "n3", ttl=2)
    jc = JobController(etcd_client, job)
    jc.tick()
    plan = records.read(etcd_client, keys.job_plan(job), Plan)
    assert plan is not None and [m.node for m in plan.members] == ["n1", "n2"]
    assert plan.spares == ["n3"]
    jc.tick()
    assert jc.status.spare_nodes == ["n3"]

    def expired() -> bool:
        register_nodes(etcd_client, job, ["n1", "n2"])
        if leader == "live":
            jc.tick()
        return etcd_client.get(keys.job_node(job, "n3")) is None

    wait_for("the spare's lease to expire", expired)
    if leader == "taking over":
        jc = JobController(etcd_client, job)  # the controller was away meanwhile
    register_nodes(etcd_client, job, ["n1", "n2"])
    jc.tick()
    assert _lost(etcd_client, job) == ["n3"]
    assert jc.status.spare_nodes == [] and jc.status.phase is JobPhase.RUNNING
