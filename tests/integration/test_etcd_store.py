"""The c10d store on etcd v3 against a real etcd, and a gloo process group bootstrapped on it.

Where ``TCPStore`` defines the semantics (``compare_set``, ``add``), the same
calls run on a real ``TCPStore`` and the answers must match.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.rendezvous.store import (
    EtcdStore,
    EtcdStoreConnectionError,
    EtcdStoreTimeoutError,
    RunLease,
)
from tests.gloo import answer_and_exit

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SHORT = timedelta(seconds=1)


@pytest.fixture
def store(etcd_client: EtcdClient, key_prefix: str) -> EtcdStore:
    return EtcdStore(etcd_client, key_prefix + "store", timeout=timedelta(seconds=5))


@pytest.fixture
def tcp_store() -> Iterator[dist.TCPStore]:
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    yield s
    del s


def test_set_get_bytes_and_str(store: EtcdStore) -> None:
    store.set("a", "text")
    store.set("b", b"\x00\xffbin")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffbin"
    store.set("a", b"again")
    assert store.get("a") == b"again"


def test_get_blocks_until_the_key_is_set(store: EtcdStore) -> None:
    writer = threading.Timer(0.5, lambda: store.set("late", "here"))
    started = time.monotonic()
    writer.start()
    assert store.get("late") == b"here"
    waited = time.monotonic() - started
    writer.join()
    assert 0.4 < waited < 3.0


def test_get_times_out_with_the_store_timeout(store: EtcdStore) -> None:
    store.set_timeout(SHORT)
    started = time.monotonic()
    with pytest.raises(EtcdStoreTimeoutError, match="never") as info:
        store.get("never")
    waited = time.monotonic() - started
    assert 0.9 < waited < 3.0
    assert isinstance(info.value, dist.DistStoreError)  # what torch callers catch


def test_wait_with_and_without_override_timeout(store: EtcdStore) -> None:
    store.set("x", "1")
    store.wait(["x"])
    store.wait(["x"], timedelta(milliseconds=1))
    started = time.monotonic()
    with pytest.raises(EtcdStoreTimeoutError, match="'y'"):
        store.wait(["x", "y"], timedelta(milliseconds=300))
    assert time.monotonic() - started < 2.5
    threading.Timer(0.3, lambda: store.set("y", "2")).start()
    store.wait(["x", "y"], timedelta(seconds=5))


def test_wait_for_several_keys_set_in_any_order(store: EtcdStore) -> None:
    def late_writes() -> None:
        for k in ("k3", "k1", "k2"):
            time.sleep(0.1)
            store.set(k, k)

    t = threading.Thread(target=late_writes)
    t.start()
    assert store.multi_get(["k1", "k2", "k3"]) == [b"k1", b"k2", b"k3"]
    t.join()


def test_check_does_not_wait(store: EtcdStore) -> None:
    store.set("here", "1")
    started = time.monotonic()
    assert store.check(["here"])
    assert not store.check(["here", "absent"])
    assert time.monotonic() - started < 1.0


def test_add_counts_like_tcpstore(store: EtcdStore, tcp_store: dist.TCPStore) -> None:
    for s in (store, tcp_store):
        assert s.add("n", 5) == 5
        assert s.add("n", -2) == 3
        assert s.add("n", 0) == 3
        assert s.get("n") == b"3"


def test_concurrent_adds_lose_nothing(etcd: EmbeddedEtcd, key_prefix: str) -> None:
    workers, each = 4, 20
    clients = [connect(EtcdOptions((etcd.endpoint,))) for _ in range(workers)]
    stores = [EtcdStore(c, key_prefix + "store") for c in clients]
    seen: list[int] = []
    lock = threading.Lock()

    def bump(s: EtcdStore) -> None:
        for _ in range(each):
            value = s.add("counter", 1)
            with lock:
                seen.append(value)

    threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert stores[0].get("counter") == str(workers * each).encode()
        assert sorted(seen) == list(range(1, workers * each + 1))  # every value once
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize(
    "calls",
    [
        [("", "first"), ("", "second"), ("first", "third"), ("wrong", "fourth")],
        [("expected", "x"), ("", "y"), ("y", "")],
        [("", ""), ("", "now-set")],
    ],
    ids=["create-then-swap", "missing-key-nonempty-expected", "empty-values"],
)
def test_compare_set_matches_tcpstore(
    store: EtcdStore, tcp_store: dist.TCPStore, calls: list[tuple[str, str]]
) -> None:
    ours = [store.compare_set("cs", e, d) for e, d in calls]
    theirs = [tcp_store.compare_set("cs", e, d) for e, d in calls]
    assert ours == theirs
    if store.check(["cs"]):
        assert store.get("cs") == tcp_store.get("cs")


def test_delete_key_and_num_keys(store: EtcdStore) -> None:
    assert store.num_keys() == 0
    store.set("a", "1")
    store.set("b", "2")
    assert store.num_keys() == 2
    assert store.delete_key("a")
    assert not store.delete_key("a")
    assert store.num_keys() == 1
    assert store.list_keys() == ["b"]


def test_multi_set_multi_get(store: EtcdStore) -> None:
    keys = [f"k{i}" for i in range(300)]  # more than one etcd transaction
    store.multi_set(keys, [str(i) for i in range(300)])
    assert store.multi_get(keys) == [str(i).encode() for i in range(300)]
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], ["1"])


def test_append(store: EtcdStore) -> None:
    store.append("log", "a")
    store.append("log", b"bc")
    assert store.get("log") == b"abc"


def test_prefixes_isolate_and_prefix_store_composes(
    etcd_client: EtcdClient, key_prefix: str
) -> None:
    one = EtcdStore(etcd_client, key_prefix + "one")
    two = EtcdStore(etcd_client, key_prefix + "two/")
    one.set("k", "from-one")
    assert not two.check(["k"])
    assert one.prefix == key_prefix + "one/"
    wrapped = dist.PrefixStore("round.3", two)  # the C++ side calls back into Python
    wrapped.set("k", "v")
    assert wrapped.get("k") == b"v"
    assert two.get("round.3/k") == b"v"
    assert wrapped.num_keys() == 1
    assert wrapped.delete_key("k")
    assert two.num_keys() == 0
    wrapped.set_timeout(timedelta(milliseconds=200))
    assert two.default_timeout == timedelta(milliseconds=200)  # reaches the etcd store
    with pytest.raises(dist.DistStoreError):
        wrapped.get("absent")
    clone = one.clone()
    assert isinstance(clone, EtcdStore) and clone.get("k") == b"from-one"


def test_keys_carry_the_run_lease(etcd_client: EtcdClient, key_prefix: str) -> None:
    lease = RunLease(etcd_client, timedelta(seconds=60))
    s = EtcdStore(etcd_client, key_prefix + "leased", lease=lease)
    s.set("a", "1")
    s.add("n", 1)
    s.multi_set(["m"], ["x"])
    current = lease.current()
    assert current is not None
    for key in ("a", "n", "m"):
        kv = etcd_client.get(s.prefix + key)
        assert kv is not None and kv.lease_id == current.id
    lease.close()


def test_connection_error_names_the_endpoints() -> None:
    server = EmbeddedEtcd().start()
    client = connect(EtcdOptions((server.endpoint,), op_timeout=timedelta(seconds=1)))
    try:
        s = EtcdStore(client, "/ringmaster-test/gone/")
        server.kill()
        with pytest.raises(EtcdStoreConnectionError, match=server.endpoint) as info:
            s.set("k", "v")
        assert isinstance(info.value, dist.DistNetworkError)
    finally:
        client.close()
        server.stop()


def _gloo_rank(endpoint: str, prefix: str, rank: int, world: int, out: Any) -> None:
    try:
        import torch

        client = connect(EtcdOptions((endpoint,)))
        store = EtcdStore(client, prefix, timeout=timedelta(seconds=30))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
        )
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        dist.barrier()
        answer = (rank, t.item())
    except BaseException:
        answer_and_exit(out, (rank, traceback.format_exc()))
    answer_and_exit(out, answer)  # the group is never freed: see answer_and_exit


@pytest.mark.timeout(90)
def test_gloo_process_group_bootstraps_through_the_store(
    etcd: EmbeddedEtcd, key_prefix: str
) -> None:
    world = 2
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_gloo_rank, args=(etcd.endpoint, key_prefix + "pg", r, world, out), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value = out.get(timeout=60)
            results[rank] = value
    except queue.Empty:
        pytest.fail(f"gloo ranks did not finish; got {results}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert results == {0: 3.0, 1: 3.0}, results


def test_get_with_revision_reports_the_key_and_a_revision_to_watch_from(
    etcd_client: EtcdClient, key_prefix: str
) -> None:
    missing, rev0 = etcd_client.get_with_revision(key_prefix + "k")
    assert missing is None and rev0 > 0
    written = etcd_client.put(key_prefix + "k", b"v")
    kv, rev1 = etcd_client.get_with_revision(key_prefix + "k")
    assert kv is not None and kv.value == b"v" and kv.mod_revision == written
    assert rev1 >= written > rev0
