"""The etcd-v3 rendezvous backend against a real etcd: every point of the contract.

torch's ``DynamicRendezvousHandler`` relies on ``get_state`` / ``set_state``
behaving exactly as its own backends do; each test pins one rule.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)

from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.rendezvous.backend import EtcdRendezvousBackend
from orchestrator.rendezvous.store import RunLease
from orchestrator.state import keys

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def backend(etcd_client: EtcdClient, key_prefix: str) -> EtcdRendezvousBackend:
    return EtcdRendezvousBackend(etcd_client, "run", key=key_prefix + "state")


def test_name_and_default_key(etcd_client: EtcdClient) -> None:
    run_id = f"job-{uuid.uuid4().hex[:8]}"
    b = EtcdRendezvousBackend(etcd_client, run_id)
    assert b.name == "etcd-v3"
    assert b.key == keys.rdzv_state(run_id) == f"/ringmaster/rdzv/{run_id}/state"


def test_empty_or_unsafe_run_id_is_rejected(etcd_client: EtcdClient) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        EtcdRendezvousBackend(etcd_client, "")
    with pytest.raises(ValueError, match="cannot be used as a key"):
        EtcdRendezvousBackend(etcd_client, "../other-run")


def test_get_state_is_none_when_absent(backend: EtcdRendezvousBackend) -> None:
    assert backend.get_state() is None


def test_set_when_absent_without_token(
    backend: EtcdRendezvousBackend, etcd_client: EtcdClient
) -> None:
    result = backend.set_state(b"state-1")
    assert result is not None
    state, token, has_set = result
    assert (state, has_set) == (b"state-1", True)
    kv = etcd_client.get(backend.key)
    assert kv is not None and token == kv.mod_revision
    assert backend.get_state() == (b"state-1", token)


def test_set_with_current_token_writes_and_moves_the_token(
    backend: EtcdRendezvousBackend,
) -> None:
    first = backend.set_state(b"state-1")
    assert first is not None
    second = backend.set_state(b"state-2", first[1])
    assert second is not None
    state, token, has_set = second
    assert (state, has_set) == (b"state-2", True)
    assert token > first[1]
    assert backend.get_state() == (b"state-2", token)


def test_stale_token_returns_current_state_without_writing(
    backend: EtcdRendezvousBackend,
) -> None:
    first = backend.set_state(b"state-1")
    assert first is not None
    second = backend.set_state(b"state-2", first[1])
    assert second is not None
    stale = backend.set_state(b"state-3", first[1])
    assert stale == (b"state-2", second[1], False)
    assert backend.get_state() == (b"state-2", second[1])


def test_no_token_when_state_exists_returns_current_without_writing(
    backend: EtcdRendezvousBackend,
) -> None:
    first = backend.set_state(b"state-1")
    assert first is not None
    assert backend.set_state(b"state-2") == (b"state-1", first[1], False)
    assert backend.get_state() == (b"state-1", first[1])


@pytest.mark.parametrize("bad", ["7", b"7", 7.0, True, 0, -3, object()])
def test_not_a_token_returns_current_state_without_writing(
    backend: EtcdRendezvousBackend, bad: object
) -> None:
    first = backend.set_state(b"state-1")
    assert first is not None
    assert backend.set_state(b"state-2", bad) == (b"state-1", first[1], False)
    assert backend.get_state() == (b"state-1", first[1])


def test_not_a_token_or_stale_token_without_state_returns_none(
    backend: EtcdRendezvousBackend,
) -> None:
    assert backend.set_state(b"state-1", "not-a-token") is None
    assert backend.set_state(b"state-1", 12345) is None
    assert backend.get_state() is None


def test_binary_state_round_trips(backend: EtcdRendezvousBackend) -> None:
    blob = bytes(range(256)) * 64
    result = backend.set_state(blob)
    assert result is not None and result[0] == blob
    assert backend.get_state() == (blob, result[1])


@pytest.mark.parametrize(
    "raw",
    [b"not a rendezvous state", b"rmrdzv1:", b"rmrdzv1:\x00\x00\x00\x00payload"],
    ids=["foreign", "truncated", "bad-checksum"],
)
def test_corrupt_state_raises_state_error(
    backend: EtcdRendezvousBackend, etcd_client: EtcdClient, raw: bytes
) -> None:
    etcd_client.put(backend.key, raw)
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.set_state(b"state-2")  # the failed write reads the corrupt state back


def test_concurrent_writers_exactly_one_wins(etcd: EmbeddedEtcd, key_prefix: str) -> None:
    writers = 4
    clients = [connect(EtcdOptions((etcd.endpoint,))) for _ in range(writers)]
    try:
        backends = [EtcdRendezvousBackend(c, "run", key=key_prefix + "state") for c in clients]
        first = backends[0].set_state(b"base")
        assert first is not None
        for round_no in range(10):
            current = backends[0].get_state()
            assert current is not None
            token = current[1]
            barrier = threading.Barrier(writers)
            results: list[tuple[bytes, int, bool] | None] = [None] * writers

            def write(
                i: int,
                barrier: threading.Barrier,
                results: list[tuple[bytes, int, bool] | None],
                token: int = token,
                round_no: int = round_no,
            ) -> None:
                barrier.wait(timeout=10)
                results[i] = backends[i].set_state(f"{round_no}-{i}".encode(), token)

            threads = [
                threading.Thread(target=write, args=(i, barrier, results)) for i in range(writers)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=20)
            assert all(r is not None for r in results)
            winners = [i for i, r in enumerate(results) if r is not None and r[2]]
            assert len(winners) == 1, results
            won = results[winners[0]]
            assert won is not None
            # Losers see exactly the winner's state and token.
            for r in results:
                assert r is not None and (r[0], r[1]) == (won[0], won[1])
            assert won[0] == f"{round_no}-{winners[0]}".encode()
            assert backends[0].get_state() == (won[0], won[1])
    finally:
        for c in clients:
            c.close()


def test_connection_error_names_the_endpoints() -> None:
    server = EmbeddedEtcd().start()
    client = connect(EtcdOptions((server.endpoint,), op_timeout=timedelta(seconds=1)))
    try:
        b = EtcdRendezvousBackend(client, "run-gone")
        server.kill()
        with pytest.raises(RendezvousConnectionError, match=server.endpoint):
            b.get_state()
        with pytest.raises(RendezvousConnectionError, match=server.endpoint):
            b.set_state(b"x")
    finally:
        client.close()
        server.stop()


def test_state_carries_the_run_lease_and_expires_after_the_last_writer(
    etcd_client: EtcdClient, key_prefix: str
) -> None:
    lease = RunLease(etcd_client, timedelta(seconds=2))
    b = EtcdRendezvousBackend(etcd_client, "run", key=key_prefix + "state", lease=lease)
    assert b.set_state(b"state-1") is not None
    kv = etcd_client.get(b.key)
    assert kv is not None and kv.lease_id != 0
    time.sleep(3)  # kept alive: the writer is still here
    assert b.get_state() is not None
    lease.close()  # the writer goes away
    deadline = time.monotonic() + 10
    while b.get_state() is not None:
        assert time.monotonic() < deadline, "state outlived its run lease"
        time.sleep(0.2)


def test_a_lost_lease_is_replaced(etcd_client: EtcdClient, key_prefix: str) -> None:
    lease = RunLease(etcd_client, timedelta(seconds=60))
    b = EtcdRendezvousBackend(etcd_client, "run", key=key_prefix + "state", lease=lease)
    first = b.set_state(b"state-1")
    assert first is not None
    stolen = lease.current()
    assert stolen is not None
    stolen.revoke()  # etcd forgets the lease (and deletes the key with it)
    again = b.set_state(b"state-2")
    assert again is not None and again[2]
    kv = etcd_client.get(b.key)
    assert kv is not None and kv.lease_id not in (0, stolen.id)
    lease.close()
