"""A replacement that waited for a spare: the controller's observer, in a real etcd,
keeps that wait apart from detection in the recovery's record and its event."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.job_observer import JobObserver
from orchestrator.observe.records import RecoveryRecord
from orchestrator.state import events, keys, records
from orchestrator.state.records import (
    JobStatus,
    Member,
    Plan,
    ProgressRecord,
    SpecRecord,
    Telemetry,
)

pytestmark = pytest.mark.integration

JOB = "spare-wait-observed"


@pytest.fixture
def observer(etcd_client: EtcdClient) -> Iterator[JobObserver]:
    etcd_client.delete_prefix(keys.job_prefix(JOB))
    spec = SpecRecord(spec={}, hash="h", submitted_at=time.time() - 60)
    records.write(etcd_client, keys.job_spec(JOB), spec)
    yield JobObserver(etcd_client, JOB, None)
    etcd_client.delete_prefix(keys.job_prefix(JOB))


def test_the_recovered_event_shows_the_wait_for_a_spare_apart_from_detection(
    observer: JobObserver, etcd_client: EtcdClient
) -> None:
    now = time.time()
    failed_at, declared_at = now - 5.0, now - 1.0  # 4 s to the declaration, 3 s of it waiting
    observer.declared({"b"}, "b exited", {}, 7, at=declared_at, seen_at=failed_at, spare_wait_s=3.0)
    plan = Plan(2, [Member("a", 0, 1), Member("c", 1, 1)])
    telemetry = Telemetry(
        generation=2, group_formed_at=now - 0.8, restored_at=now - 0.6, first_step_at=now - 0.5
    )
    progress = {
        w: ProgressRecord(7, 2, rank, 2, 100 + rank, now, now, telemetry=telemetry)
        for rank, w in enumerate(("a-0", "c-0"))
    }
    status = JobStatus(JOB, JobPhase.RECOVERING, step=7)
    record = observer.recovered(status, plan, progress)
    assert record is not None and record.spare_wait_s == pytest.approx(3.0)
    assert sum(record.phases.values()) == pytest.approx(record.total_s) == pytest.approx(4.5)
    stored = records.read(etcd_client, keys.job_recovery(JOB, record.run, 2), RecoveryRecord)
    assert stored is not None and stored.spare_wait_s == pytest.approx(3.0)
    (event,) = [e for e in events.list_events(etcd_client, JOB) if e.type == "Recovered"]
    assert "detect 4.00s (of which 3.00s waiting for a spare), rendezvous 0.20s" in (
        event.message
    ), event.message
    assert event.data["spare_wait_s"] == pytest.approx(3.0)
    assert status.last_recovery is not None
    assert status.last_recovery["spare_wait_s"] == pytest.approx(3.0)
