"""The operator's etcd records against a real etcd (the session's embedded one).

Marked ``integration``: it uses the ``etcd`` fixture (a real etcd binary on
loopback), unlike the other operator tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.operator.api import RetryableOperatorError
from orchestrator.operator.records import EtcdJobRecords
from orchestrator.process_lifetime import free_port
from orchestrator.spec.job import EntrypointSpec, JobSpec, NodesSpec
from orchestrator.state import jobs, keys
from orchestrator.state.records import JobStatus, write

pytestmark = pytest.mark.integration


def spec(name: str, max_nodes: int = 2) -> JobSpec:
    return JobSpec(
        name=name, entrypoint=EntrypointSpec(script="t.py"), nodes=NodesSpec(1, max_nodes, 1)
    )


@pytest.fixture
def records() -> Iterator[EtcdJobRecords]:
    out = EtcdJobRecords()
    try:
        yield out
    finally:
        out.close()


def test_submit_then_idempotent_then_update(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, records: EtcdJobRecords, key_prefix: str
) -> None:
    name = "rec-" + key_prefix.strip("/").split("/")[-1][:8]
    endpoints = (etcd.endpoint,)
    assert records.ensure_spec(endpoints, spec(name)) is True
    assert jobs.read_spec(etcd_client, name)[0].nodes.max == 2
    assert records.read_status(endpoints, name)["phase"] == "Pending"  # type: ignore[index]
    assert records.ensure_spec(endpoints, spec(name)) is False
    assert records.ensure_spec(endpoints, spec(name, max_nodes=4)) is True
    assert jobs.read_spec(etcd_client, name)[0].nodes.max == 4
    records.forget(endpoints, name)
    assert etcd_client.get_prefix(keys.job_prefix(name)) == []


def test_a_finished_job_is_not_restarted_by_a_resync(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, records: EtcdJobRecords, key_prefix: str
) -> None:
    name = "fin-" + key_prefix.strip("/").split("/")[-1][:8]
    endpoints = (etcd.endpoint,)
    records.ensure_spec(endpoints, spec(name))
    done = JobStatus(name, phase=JobPhase.SUCCEEDED, step=100)
    write(etcd_client, keys.job_status(name), done)
    assert records.ensure_spec(endpoints, spec(name)) is False
    assert records.read_status(endpoints, name)["phase"] == "Succeeded"  # type: ignore[index]
    # a changed spec after the end runs the job again
    assert records.ensure_spec(endpoints, spec(name, max_nodes=3)) is True
    assert records.read_status(endpoints, name)["phase"] == "Pending"  # type: ignore[index]
    records.forget(endpoints, name)


def test_unreachable_etcd_is_retryable() -> None:
    quick = EtcdJobRecords(EtcdOptions(endpoints=(), connect_timeout=timedelta(seconds=0.5)))
    with pytest.raises(RetryableOperatorError, match="could not reach etcd"):
        quick.read_status((f"127.0.0.1:{free_port()}",), "x")
