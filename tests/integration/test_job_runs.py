"""A job name has runs: a finished job submitted again starts its next run on a live controller.

Real etcd; the controller service is ticked in-process (no agents needed: a
stop before the start ends a run at once).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from orchestrator import events, jobs, keys, records
from orchestrator.api import JobNotFoundError, JobPhase
from orchestrator.controller.service import Controller
from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.records import RecoveryRecord
from orchestrator.records import Plan, ResumeRequest
from orchestrator.runs import list_runs
from orchestrator.spec import CheckpointSpec, EntrypointSpec, JobSpec

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
    with pytest.raises(jobs.JobExistsError):
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
