"""The sampled job history in a real etcd stays bounded and keeps its time span."""

from __future__ import annotations

import pytest

from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.history import HistoryWriter, read_history
from orchestrator.observe.records import HistorySample
from orchestrator.state import keys

pytestmark = pytest.mark.integration


def test_history_is_thinned_not_truncated(etcd_client: EtcdClient) -> None:
    job = "history-bounded"
    etcd_client.delete_prefix(keys.job_prefix(job))
    writer = HistoryWriter(etcd_client, job, max_samples=20)
    for i in range(60):
        writer.append(HistorySample(float(i), i, 1.0, None, 1.0 / (i + 1), "Running", 2))
    samples = read_history(etcd_client, job)
    assert len(samples) <= 20
    steps = [s.step for s in samples]
    assert steps == sorted(steps)
    assert steps[0] == 0 and steps[-1] == 59  # the whole span is still covered
    assert samples[-1].loss == pytest.approx(1 / 60)
    etcd_client.delete_prefix(keys.job_prefix(job))
