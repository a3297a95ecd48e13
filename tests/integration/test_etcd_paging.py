"""Range reads in pages at one revision, gRPC limits, and writes refused for their size.

Against the real etcd of the test fixtures.
"""

from __future__ import annotations

import threading

import pytest

from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.diagnosis import EtcdRequestTooLargeError
from orchestrator.etcd.members import MAX_REQUEST_BYTES
from orchestrator.etcd.ranges import FIRST_PAGE_KEYS
from orchestrator.etcd.transactions import MAX_TXN_OPS, REQUEST_OVERHEAD_BYTES

pytestmark = pytest.mark.integration


def _ranges(client: EtcdClient) -> list[tuple[int, int | None]]:
    """Record ``(limit, revision)`` of every page the client asks for from now on."""
    seen: list[tuple[int, int | None]] = []
    original = client.ranges.page

    def spy(start, end, limit, revision, keys_only, what):  # type: ignore[no-untyped-def]
        seen.append((limit, revision))
        return original(start, end, limit, revision, keys_only, what)

    client.ranges.page = spy  # type: ignore[method-assign]
    return seen


def test_prefix_with_more_keys_than_a_page(etcd_client: EtcdClient, key_prefix: str) -> None:
    count = FIRST_PAGE_KEYS * 3 + 7
    etcd_client.put_many([(f"{key_prefix}k{i:05d}", f"v{i}".encode()) for i in range(count)])
    pages = _ranges(etcd_client)
    got = etcd_client.get_prefix(key_prefix)
    assert [kv.key for kv in got] == [f"{key_prefix}k{i:05d}" for i in range(count)]
    assert [kv.value for kv in got] == [f"v{i}".encode() for i in range(count)]
    # a first page, then pages sized from what it held, all at the first page's revision
    assert pages[0][0] == FIRST_PAGE_KEYS and pages[0][1] is None
    assert len(pages) >= 2
    assert len({rev for _, rev in pages[1:]}) == 1 and pages[1][1] is not None
    assert etcd_client.get_keys(key_prefix) == [kv.key for kv in got]


def test_values_larger_than_a_page_budget(etcd_client: EtcdClient, key_prefix: str) -> None:
    """Values of 600 KiB: about one per page of 1 MiB; 10 of them (6 MiB) still read."""
    big = 600 * 1024
    items = [(f"{key_prefix}big{i:02d}", bytes([i]) * big) for i in range(10)]
    for key, value in items:
        etcd_client.put(key, value)
    pages = _ranges(etcd_client)
    got = etcd_client.get_prefix(key_prefix)
    assert [(kv.key, kv.value) for kv in got] == items
    # after the first page, each asks for what fits in PAGE_BYTES: one such value
    assert all(limit == 1 for limit, _ in pages[1:])


def test_more_than_grpc_default_limit_in_total(etcd_client: EtcdClient, key_prefix: str) -> None:
    """Over gRPC's default 4 MiB receive limit in total, and over 16 MiB in the first page."""
    value = b"x" * (1024 * 1024)  # 1 MiB each: 64 would be a 64 MiB first page
    count = 24
    etcd_client.put_many([(f"{key_prefix}m{i:02d}", value) for i in range(count)])
    got = etcd_client.get_prefix(key_prefix)
    assert len(got) == count and all(kv.value == value for kv in got)
    many = etcd_client.get_many([f"{key_prefix}m{i:02d}" for i in range(count)] + ["/nope"])
    assert sorted(many) == [f"{key_prefix}m{i:02d}" for i in range(count)]
    assert all(kv.value == value for kv in many.values())


def test_a_paged_read_is_one_snapshot(etcd_client: EtcdClient, key_prefix: str) -> None:
    """Writes made between two pages are not seen: every page is read at the first's revision."""
    count = FIRST_PAGE_KEYS * 4
    etcd_client.put_many([(f"{key_prefix}s{i:05d}", b"old") for i in range(count)])
    original = etcd_client.ranges.page
    calls = 0

    def write_between_pages(start, end, limit, revision, keys_only, what):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 2:  # after the first page: change keys on both sides of it
            etcd_client.put(f"{key_prefix}s00000", b"new")
            etcd_client.put(f"{key_prefix}s{count - 1:05d}", b"new")
            etcd_client.put(f"{key_prefix}s{count:05d}", b"added")
            etcd_client.delete(f"{key_prefix}s{count - 2:05d}")
        return original(start, end, min(limit, 50), revision, keys_only, what)

    etcd_client.ranges.page = write_between_pages  # type: ignore[method-assign]
    got = etcd_client.get_prefix(key_prefix)
    assert calls > 2
    assert len(got) == count and {kv.value for kv in got} == {b"old"}
    etcd_client.ranges.page = original  # type: ignore[method-assign]
    now = {kv.key: kv.value for kv in etcd_client.get_prefix(key_prefix)}
    assert now[f"{key_prefix}s{count - 1:05d}"] == b"new" and len(now) == count


def test_get_many_is_one_snapshot(etcd_client: EtcdClient, key_prefix: str) -> None:
    count = MAX_TXN_OPS * 2 + 5
    keys = [f"{key_prefix}g{i:05d}" for i in range(count)]
    etcd_client.put_many([(k, b"old") for k in keys])
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            etcd_client.put_many([(k, b"new") for k in keys[::50]])

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        for _ in range(20):
            got = etcd_client.get_many(keys)
            # one revision for every batch: keys written together look the same
            assert len({got[k].value for k in keys[::50]}) == 1
    finally:
        stop.set()
        thread.join(5)


def test_child_names_reads_one_page_per_big_child(etcd_client: EtcdClient, key_prefix: str) -> None:
    names = ["a", "a-b", "b", "c"]
    items = [(f"{key_prefix}{n}/k{i:05d}", b"v") for n in names for i in range(300)]
    items.append((f"{key_prefix}d", b"no slash"))
    etcd_client.put_many(items)
    pages = _ranges(etcd_client)
    assert etcd_client.child_names(key_prefix) == [*names, "d"]
    # not every key was listed: the 1,201 keys took a page per child or fewer
    assert len(pages) <= len(names) + 1


def test_put_over_etcd_request_limit_is_refused_here(
    etcd_client: EtcdClient, key_prefix: str
) -> None:
    key = key_prefix + "huge"
    with pytest.raises(EtcdRequestTooLargeError, match=f"refusing to write {key}: 1572864 bytes"):
        etcd_client.put(key, b"x" * (MAX_REQUEST_BYTES - len(key)))
    with pytest.raises(EtcdRequestTooLargeError, match=key):
        etcd_client.put_many([(key_prefix + "ok", b"1"), (key, b"x" * MAX_REQUEST_BYTES)])
    with pytest.raises(EtcdRequestTooLargeError, match=key):
        etcd_client.create(key, b"x" * MAX_REQUEST_BYTES)
    assert etcd_client.get_prefix(key_prefix) == []  # nothing was written
    # just under the limit goes through
    fits = b"y" * (MAX_REQUEST_BYTES - REQUEST_OVERHEAD_BYTES - len(key))
    etcd_client.put(key, fits)
    got = etcd_client.get(key)
    assert got is not None and got.value == fits


def test_etcd_refusing_a_large_request_is_a_named_permanent_error(
    etcd_client: EtcdClient, key_prefix: str
) -> None:
    """A transaction over etcd's limit (not caught by the per-key check) fails at once."""
    value = b"z" * (1024 * 1024)
    keys = [key_prefix + "t1", key_prefix + "t2"]

    def txn(c):  # type: ignore[no-untyped-def]
        ops = [c.transactions.put(k, value) for k in keys]
        return c.transaction(compare=[], success=ops, failure=[])

    with pytest.raises(EtcdRequestTooLargeError, match=r"request is too large|larger than max"):
        etcd_client.transport.call(txn, what=" writing two keys")


def test_keep_newest_trims_the_oldest(etcd_client: EtcdClient, key_prefix: str) -> None:
    etcd_client.put_many([(f"{key_prefix}{i:04d}", b"e") for i in range(30)])
    assert etcd_client.keep_newest(key_prefix, 25, slack=10) == 0  # within the slack
    assert etcd_client.keep_newest(key_prefix, 10, slack=2) == 20
    assert etcd_client.get_keys(key_prefix) == [f"{key_prefix}{i:04d}" for i in range(20, 30)]


def test_events_keep_the_newest(
    etcd_client: EtcdClient, monkeypatch: pytest.MonkeyPatch, key_prefix: str
) -> None:
    from orchestrator.state import events, keys

    monkeypatch.setattr(keys, "EVENTS_KEPT", 20)
    monkeypatch.setattr(events, "TRIM_SLACK", 5)
    job = "bounded-" + key_prefix.strip("/").rsplit("/", 1)[-1][:8]
    for i in range(60):
        events.emit(etcd_client, job, "Test", f"event {i}")
        assert etcd_client.count_prefix(keys.job_events(job)) <= 25
    kept = [e.message for e in events.list_events(etcd_client, job)]
    assert 20 <= len(kept) <= 25
    assert kept == [f"event {i}" for i in range(60 - len(kept), 60)]  # the newest, in order
    etcd_client.delete_prefix(keys.job_prefix(job))
