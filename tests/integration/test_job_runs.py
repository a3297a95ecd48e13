"""A job name has runs: a finished job submitted again starts its next run on a live controller.

Real etcd; the controller service is ticked in-process (no agents needed: a
stop before the start ends a run at once).
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest

from orchestrator.api import JobNotFoundError, JobPhase
from orchestrator.controller.service import Controller
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.observe.records import RecoveryRecord
from orchestrator.operator.records import EtcdJobRecords
from orchestrator.spec.job import CheckpointSpec, EntrypointSpec, JobSpec
from orchestrator.state import events, jobs, keys, records
from orchestrator.state.api import JobExistsError
from orchestrator.state.records import Plan, ResumeRequest
from orchestrator.state.runs import list_runs

pytestmark = pytest.mark.integration


def _spec(name: str) -> JobSpec:
    # a checkpoint root of its own (the controller holds it while the job runs)
    checkpoint = CheckpointSpec(url=f"memory://controller-tests/{name}")
    return JobSpec(
        name=name, entrypoint=EntrypointSpec(script="train.py"), checkpoint=checkpoint
    ).validate()


def _stop_and_tick(controller: Controller, client: EtcdClient, name: str) -> records.JobStatus:
    jobs.request_stop(client, name)
    controller.tick()
    status = jobs.read_status(client, name)
    assert status is not None
    return status


def test_a_finished_job_runs_again_on_the_same_controller(etcd_client: EtcdClient) -> None:
    name = f"runs-{uuid.uuid4().hex[:8]}"
    controller = Controller(etcd_client, job=name)
    assert controller.election.try_acquire()  # a controller decides only the jobs it leads
    assert jobs.submit(etcd_client, _spec(name)) == 1
    controller.tick()
    first = _stop_and_tick(controller, etcd_client, name)
    assert first.phase is JobPhase.STOPPED and first.run == 1
    # what the first run leaves: a recovery record and a plan (the plan belongs to the run)
    old = RecoveryRecord(3, "agent_gone", ["n1"], "why", 1.0, 2.0, 3.0, 4.0, 5.0, run=1)
    records.write(etcd_client, keys.job_recovery(name, 1, 3), old)
    records.write(etcd_client, keys.job_plan(name), Plan(3, []))
    with pytest.raises(JobExistsError):
        jobs.submit(etcd_client, _spec(name), replace_finished=False)

    time.sleep(0.01)  # the runs' windows must not touch
    resume = ResumeRequest("file:///tmp/ck/step-0000000010", 10, 2)
    assert jobs.submit(etcd_client, _spec(name), resume=resume) == 2
    assert records.read(etcd_client, keys.job_plan(name), Plan) is None
    controller.tick()  # the same controller takes up run 2 ...
    second = _stop_and_tick(controller, etcd_client, name)  # ... and a stop reaches it
    assert second.phase is JobPhase.STOPPED and second.run == 2

    runs = list_runs(etcd_client, name)
    assert [r.run for r in runs] == [1, 2] and runs[1].resume == resume
    kept = records.read_all(etcd_client, keys.job_recoveries(name), RecoveryRecord)
    assert list(kept.values()) == [old]
    one = [e.message for e in events.list_events(etcd_client, name, run=1)]
    two = [e.message for e in events.list_events(etcd_client, name, run=2)]
    assert "Stopped: stopped before it started" in " ".join(one)
    assert "Stopped: stopped before it started" in " ".join(two)
    assert one[0] == "run 1 submitted"
    assert two[0] == (
        "run 2 submitted, resuming from the checkpoint of step 10 (file:///tmp/ck/step-0000000010)"
    )
    assert len(events.list_events(etcd_client, name)) == len(one) + len(two)
    with pytest.raises(JobNotFoundError, match=r"no run 3 \(runs: 1, 2\)"):
        events.list_events(etcd_client, name, run=3)
    controller.election.resign()


def test_controllers_of_two_jobs_on_one_etcd_both_lead(etcd_client: EtcdClient) -> None:
    """Each job's controllers (``--job``, one per TrainingJob) elect their own leader."""
    a, b = (Controller(etcd_client, job=f"lead-{x}-{uuid.uuid4().hex[:6]}") for x in "ab")
    # the controllers of every job elect one of them for their own duties; for each
    # job they campaign on that job's key (test_one_leader_per_job)
    everything = Controller(etcd_client)
    stop = threading.Event()
    try:
        for c in (a, b, everything):
            assert c.election.wait_for_leadership(stop), f"{c.job or 'all jobs'} never led"
        assert a.election.is_leader and b.election.is_leader and everything.election.is_leader
        assert len({a.election.key, b.election.key, everything.election.key}) == 3
        second_a = Controller(etcd_client, job=a.job)  # a standby of job a still waits
        assert not second_a.election.try_acquire()
        assert a.election.current_leader() is not None
    finally:
        for c in (a, b, everything):
            c.election.resign()


def test_a_spec_changed_in_place_keeps_its_run_and_reaches_the_controller(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient
) -> None:
    """The operator's update of a running TrainingJob (`EtcdJobRecords.ensure_spec`):
    the record keeps its run and resume point, and the leading controller decides by the
    new spec from its next tick (here a shorter ``rendezvous.join_timeout`` fails the job
    that no node joined; with the spec it read first it would wait 600 s)."""
    name = f"inplace-{uuid.uuid4().hex[:8]}"
    controller = Controller(etcd_client, job=name)
    assert controller.election.try_acquire()
    updates = EtcdJobRecords()
    try:
        jobs.submit(etcd_client, _spec(name))
        controller.tick()
        jobs.request_stop(etcd_client, name)
        controller.tick()
        resume = ResumeRequest("file:///tmp/ck/step-0000000010", 10, 2)
        assert jobs.submit(etcd_client, _spec(name), resume=resume) == 2
        controller.tick()
        changed = _spec(name)
        changed.rendezvous.join_timeout = timedelta(milliseconds=50)
        assert updates.ensure_spec((etcd.endpoint,), changed)
        record = jobs.read_spec_record(etcd_client, name)
        assert (record.run, record.resume) == (2, resume)
        deadline = time.monotonic() + 30
        status = jobs.read_status(etcd_client, name)
        while status is not None and status.phase is JobPhase.PENDING:
            assert time.monotonic() < deadline, status
            controller.tick()
            status = jobs.read_status(etcd_client, name)
        assert status is not None and status.phase is JobPhase.FAILED, status
        assert status.run == 2 and "rendezvous.join_timeout" in status.message, status
    finally:
        updates.close()
        controller.election.resign()
