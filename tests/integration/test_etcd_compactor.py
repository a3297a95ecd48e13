"""The leading controller's compaction of etcd's history, on a real etcd of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.compactor import HistoryCompactor, compaction_target
from orchestrator.etcd.diagnosis import EtcdCompactedError
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions

pytestmark = pytest.mark.integration


@pytest.fixture
def client() -> Iterator[EtcdClient]:
    with EmbeddedEtcd() as server:
        c = connect(EtcdOptions(endpoints=[server.endpoint]))
        try:
            yield c
        finally:
            c.close()


def test_compaction_target_keeps_the_newest_revisions() -> None:
    assert compaction_target(current=100, compacted=0, keep=10) == 90
    assert compaction_target(current=100, compacted=90, keep=10) is None
    assert compaction_target(current=5, compacted=0, keep=10) is None


def test_compact_once_drops_history_older_than_keep(client: EtcdClient) -> None:
    for i in range(30):
        client.put("/t/key", str(i))
    current = client.current_revision()
    compactor = HistoryCompactor(client, every=timedelta(seconds=1), keep=5)
    assert compactor.compact_once() == current - 5
    # etcd itself says the history below it is gone: compacting there again is refused
    with pytest.raises(EtcdCompactedError):
        client.compact(current - 6)
    assert client.get("/t/key").value == b"29"  # live keys stay
    assert compactor.compact_once() is None  # nothing new to drop


def test_compactor_runs_only_while_leading(client: EtcdClient) -> None:
    for i in range(20):
        client.put("/t/key", str(i))
    leading = threading.Event()
    compactor = HistoryCompactor(client, every=timedelta(seconds=0.05), keep=3)
    stop = threading.Event()
    thread = threading.Thread(target=compactor.run, args=(stop, leading.is_set))
    thread.start()
    try:
        time.sleep(0.3)
        assert compactor.compacted == 0  # a standby compacts nothing
        leading.set()
        deadline = time.monotonic() + 5
        while compactor.compacted == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert compactor.compacted == client.current_revision() - 3
    finally:
        stop.set()
        thread.join(timeout=5)


def test_every_zero_means_never(client: EtcdClient) -> None:
    client.put("/t/key", "x")
    compactor = HistoryCompactor(client, every=timedelta(0), keep=0)
    stop = threading.Event()
    started = time.monotonic()
    compactor.run(stop)  # returns at once instead of looping
    assert time.monotonic() - started < 1
    assert compactor.compacted == 0
