"""The etcd wrapper against a real etcd server."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from orchestrator.api import EtcdUnavailableError
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.diagnosis import EtcdLeaseNotFoundError
from orchestrator.etcd.kv import WatchEvent
from orchestrator.etcd.options import EtcdOptions
from orchestrator.process_lifetime import free_port
from orchestrator.state import records

pytestmark = pytest.mark.integration


def test_put_get_delete_prefix(etcd_client: EtcdClient, key_prefix: str) -> None:
    rev = etcd_client.put(key_prefix + "a", "1")
    etcd_client.put(key_prefix + "b", b"2")
    got = etcd_client.get(key_prefix + "a")
    assert got is not None and got.value == b"1" and got.mod_revision == rev
    assert [kv.key for kv in etcd_client.get_prefix(key_prefix)] == [
        key_prefix + "a",
        key_prefix + "b",
    ]
    assert etcd_client.delete(key_prefix + "a")
    assert etcd_client.get(key_prefix + "a") is None
    assert etcd_client.delete_prefix(key_prefix) == 1
    assert etcd_client.get_prefix(key_prefix) == []


def test_record_round_trip(etcd_client: EtcdClient, key_prefix: str) -> None:
    done = records.DoneRecord(step=3, generation=1, at=2.5)
    records.write(etcd_client, key_prefix + "j", done)
    assert records.read(etcd_client, key_prefix + "j", records.DoneRecord) == done
    assert records.read(etcd_client, key_prefix + "missing", records.DoneRecord) is None
    etcd_client.put(key_prefix + "bad", b'{"v": 1, "step": 3}')
    with pytest.raises(records.RecordError, match=f"{key_prefix}bad: DoneRecord is missing"):
        records.read_all(etcd_client, key_prefix, records.DoneRecord)


def test_lease_expiry_removes_key(etcd_client: EtcdClient, key_prefix: str) -> None:
    lease = etcd_client.lease(1)
    etcd_client.put(key_prefix + "leased", "x", lease=lease)
    etcd_client.put(key_prefix + "plain", "y")
    assert etcd_client.get(key_prefix + "leased") is not None
    deadline = time.monotonic() + 10
    while etcd_client.get(key_prefix + "leased") is not None:
        assert time.monotonic() < deadline, "leased key outlived its lease"
        time.sleep(0.2)
    assert etcd_client.get(key_prefix + "plain") is not None


def test_lease_keepalive_keeps_key(etcd_client: EtcdClient, key_prefix: str) -> None:
    lease = etcd_client.lease(1)
    lease.keep_alive(interval=0.2)
    etcd_client.put(key_prefix + "kept", "x", lease=lease)
    time.sleep(2.5)
    assert etcd_client.get(key_prefix + "kept") is not None
    lease.revoke()
    assert etcd_client.get(key_prefix + "kept") is None


def test_watch_sees_put_and_delete(etcd_client: EtcdClient, key_prefix: str) -> None:
    seen: list[WatchEvent] = []
    watch = etcd_client.watch(key_prefix, prefix=True)

    def consume() -> None:
        for ev in watch:
            seen.append(ev)
            if len(seen) == 2:
                return

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    etcd_client.put(key_prefix + "w", "v1")
    etcd_client.delete(key_prefix + "w")
    t.join(timeout=10)
    watch.cancel()
    assert [(e.key, e.value, e.deleted) for e in seen] == [
        (key_prefix + "w", b"v1", False),
        (key_prefix + "w", None, True),
    ]


def test_compare_and_set_loses_when_revision_moved(
    etcd_client: EtcdClient, key_prefix: str
) -> None:
    key = key_prefix + "cas"
    assert etcd_client.create(key, "first")
    assert not etcd_client.create(key, "second"), "create must fail on an existing key"
    seen = etcd_client.get(key)
    assert seen is not None
    etcd_client.put(key, "someone else")  # the revision moves under us
    ok, current = etcd_client.compare_and_set(key, "mine", seen.mod_revision)
    assert not ok
    assert current is not None and current.value == b"someone else"
    ok, current = etcd_client.compare_and_set(key, "mine", current.mod_revision)
    assert ok and current is not None and current.value == b"mine"
    kv = etcd_client.get(key)
    assert kv is not None and kv.value == b"mine"


def test_unreachable_etcd_fails_fast_naming_endpoints() -> None:
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    start = time.monotonic()
    with pytest.raises(EtcdUnavailableError) as info:
        connect(EtcdOptions(tuple(dead), connect_timeout=timedelta(seconds=1)))
    elapsed = time.monotonic() - start
    assert elapsed < 4, f"took {elapsed:.1f}s for a 1s connect timeout"
    for ep in dead:
        assert ep in str(info.value)
    assert "within 1s" in str(info.value)


def test_fails_over_to_a_live_endpoint(etcd, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    dead = f"127.0.0.1:{free_port()}"
    client = connect(EtcdOptions((dead, etcd.endpoint), connect_timeout=timedelta(seconds=3)))
    try:
        for i in range(5):  # whichever endpoint it starts on, every call succeeds
            client.put(key_prefix + f"k{i}", str(i))
        assert len(client.get_prefix(key_prefix)) == 5
    finally:
        client.close()


def test_write_under_a_revoked_lease_is_named(etcd_client: EtcdClient, key_prefix: str) -> None:
    lease = etcd_client.lease(5)
    lease.revoke()
    with pytest.raises(EtcdLeaseNotFoundError, match="no such lease"):
        etcd_client.put(f"{key_prefix}/leased", "v", lease=lease)
    assert etcd_client.get(f"{key_prefix}/leased") is None
