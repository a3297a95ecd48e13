"""The controller's observer sums the checkpoint stalls of whichever process is rank 0,
in a real etcd: a rank 0 that goes and one that takes its place, a controller that
takes over a running job."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.job_observer import JobObserver
from orchestrator.state import keys, records
from orchestrator.state.records import (
    JobStatus,
    Member,
    Plan,
    ProgressRecord,
    SpecRecord,
    Telemetry,
)

pytestmark = pytest.mark.integration

JOB = "stalls-observed"


def beat(rank: int, pid: int, stalled: float, generation: int = 1) -> ProgressRecord:
    now = time.time()
    return ProgressRecord(
        step=10,
        generation=generation,
        rank=rank,
        world_size=2,
        pid=pid,
        beat=now,
        step_time=now,
        telemetry=Telemetry(
            generation=generation, first_step_at=now - 5, checkpoint_stall_s=stalled
        ),
    )


def plan(generation: int, *nodes: str) -> Plan:
    return Plan(generation, [Member(n, rank_base=i, nproc=1) for i, n in enumerate(nodes)])


@pytest.fixture
def observer(etcd_client: EtcdClient) -> Iterator[JobObserver]:
    etcd_client.delete_prefix(keys.job_prefix(JOB))
    spec = SpecRecord(spec={}, hash="h", submitted_at=time.time() - 10)
    records.write(etcd_client, keys.job_spec(JOB), spec)
    yield JobObserver(etcd_client, JOB, None)
    etcd_client.delete_prefix(keys.job_prefix(JOB))


def test_only_rank_0_counts_and_its_successor_adds_only_its_own_stalls_from_then(
    observer: JobObserver,
) -> None:
    status = JobStatus(JOB, JobPhase.RUNNING, step=10)
    gen1 = plan(1, "a", "b")
    observer.observe(status, gen1, {}, {"a-0": beat(0, 100, 0.0), "b-0": beat(1, 200, 0.0)})
    observer.observe(status, gen1, {}, {"a-0": beat(0, 100, 0.4), "b-0": beat(1, 200, 0.5)})
    assert observer.checkpoint_stall_s == pytest.approx(0.4)  # rank 0's, not the sum
    # a goes; b is rank 0 of generation 2: what b stalled as rank 1 was counted as a's
    gen2 = plan(2, "b", "c")
    observer.observe(status, gen2, {}, {"b-0": beat(0, 200, 0.5, 2), "c-0": beat(1, 300, 0.0, 2)})
    assert observer.checkpoint_stall_s == pytest.approx(0.4)
    observer.observe(status, gen2, {}, {"b-0": beat(0, 200, 0.8, 2), "c-0": beat(1, 300, 0.3, 2)})
    assert observer.checkpoint_stall_s == pytest.approx(0.7)
    assert status.training_time is not None
    assert status.training_time.checkpoint_s == pytest.approx(0.7)


def test_a_controller_that_takes_over_goes_on_from_the_status_it_finds(
    observer: JobObserver, etcd_client: EtcdClient
) -> None:
    status = JobStatus(JOB, JobPhase.RUNNING, step=10)
    gen1 = plan(1, "a", "b")
    observer.observe(status, gen1, {}, {"a-0": beat(0, 100, 0.0), "b-0": beat(1, 200, 0.0)})
    observer.observe(status, gen1, {}, {"a-0": beat(0, 100, 0.4), "b-0": beat(1, 200, 0.4)})
    assert status.training_time is not None
    found = JobStatus.from_dict(status.to_dict())  # as the next controller reads it
    after = JobObserver(etcd_client, JOB, None)
    after.adopt(found)
    # its first look sees totals the controller before counted: they are the base
    after.observe(found, gen1, {}, {"a-0": beat(0, 100, 0.4), "b-0": beat(1, 200, 0.4)})
    assert after.checkpoint_stall_s == pytest.approx(0.4)
    after.observe(found, gen1, {}, {"a-0": beat(0, 100, 0.6), "b-0": beat(1, 200, 0.6)})
    assert after.checkpoint_stall_s == pytest.approx(0.6)
