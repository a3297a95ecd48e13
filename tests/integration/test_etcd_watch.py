"""Following a key through broken watch streams and compactions (KeyFollower).

Against the real etcd of the test fixtures.  The follower's client reaches
etcd through a TCP relay (:mod:`tests.etcd_relay`); cutting the relay's connections breaks
its watch stream as a lost member or network would, while a second client
writes directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.kv import Watch, WatchEvent
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.watch import KeyFollower
from tests.etcd_relay import Relay

pytestmark = pytest.mark.integration

WAIT = 30.0


class Seen:
    """What a follower handed on, with waits on it."""

    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self._cond = threading.Condition()

    def __call__(self, event: WatchEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def values(self) -> list[bytes | None]:
        with self._cond:
            return [e.value for e in self.events]

    def wait_for(self, done: Callable[[list[WatchEvent]], bool]) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: done(self.events), WAIT), self.events


class Spied:
    """Records the start revision of each watch and how often the key was read."""

    def __init__(self, client: EtcdClient) -> None:
        self.starts: list[int | None] = []
        self.reads = 0
        self.ended = threading.Event()  # a watch stream ended (set by the test's wrapper)
        watch, get_with_revision = client.watch, client.get_with_revision

        def spied_watch(key: str, *, prefix: bool = False, start_revision: int | None = None):  # type: ignore[no-untyped-def]
            self.starts.append(start_revision)
            return _Ends(watch(key, prefix=prefix, start_revision=start_revision), self.ended)

        def spied_read(key: str):  # type: ignore[no-untyped-def]
            self.reads += 1
            return get_with_revision(key)

        client.watch = spied_watch  # type: ignore[method-assign]
        client.get_with_revision = spied_read  # type: ignore[method-assign]


class _Ends(Watch):
    def __init__(self, inner: Watch, ended: threading.Event) -> None:
        super().__init__(iter(()), inner.cancel)
        self._inner, self._ended = inner, ended

    def __iter__(self) -> Iterator[WatchEvent]:
        try:
            yield from self._inner
        finally:
            self._ended.set()


@pytest.fixture
def relayed(etcd: EmbeddedEtcd) -> Iterator[tuple[Relay, EtcdClient]]:
    relay = Relay(etcd.endpoint)
    options = EtcdOptions((relay.endpoint,), op_timeout=timedelta(seconds=2))
    client = connect(options)
    try:
        yield relay, client
    finally:
        client.close()
        relay.close()


def test_first_start_hands_on_what_is_stored(etcd_client: EtcdClient, key_prefix: str) -> None:
    etcd_client.put(key_prefix + "a", b"1")
    etcd_client.put(key_prefix + "b", b"2")
    seen = Seen()
    follower = KeyFollower(etcd_client, key_prefix, seen, prefix=True).start()
    try:
        seen.wait_for(lambda events: len(events) == 2)
        etcd_client.delete(key_prefix + "a")
        etcd_client.put(key_prefix + "c", b"3")
        seen.wait_for(lambda events: len(events) == 4)
    finally:
        follower.stop()
        assert follower.join(WAIT)
    assert [(e.key[len(key_prefix) :], e.value) for e in seen.events] == [
        ("a", b"1"),
        ("b", b"2"),
        ("a", None),
        ("c", b"3"),
    ]


def test_a_broken_stream_resumes_after_the_last_revision_seen(
    relayed: tuple[Relay, EtcdClient], etcd_client: EtcdClient, key_prefix: str
) -> None:
    relay, client = relayed
    key = key_prefix + "k"
    etcd_client.put(key, b"0")
    spied = Spied(client)
    seen = Seen()
    follower = KeyFollower(client, key, seen, retry_pause=timedelta(seconds=0.1)).start()
    try:
        seen.wait_for(lambda events: len(events) == 1)  # the first read
        for i in range(1, 4):
            etcd_client.put(key, str(i).encode())
        seen.wait_for(lambda events: len(events) == 4)
        last = seen.events[-1].mod_revision

        relay.cut()  # the stream breaks; writes go on while no watch can run
        assert spied.ended.wait(WAIT)
        for i in range(4, 8):
            etcd_client.put(key, str(i).encode())
        relay.restore()
        seen.wait_for(lambda events: len(events) == 8)
        etcd_client.put(key, b"8")  # and the renewed watch goes on
        seen.wait_for(lambda events: len(events) == 9)
    finally:
        follower.stop()
        assert follower.join(WAIT)
    # every write once, in order: none missed, none handed on twice
    assert seen.values() == [str(i).encode() for i in range(9)]
    revisions = [e.mod_revision for e in seen.events]
    assert revisions == sorted(set(revisions))
    assert spied.reads == 1  # read at the first start only
    # each watch after the break (some refused while the relay was cut) resumed there
    assert len(spied.starts) >= 2 and set(spied.starts[1:]) == {last + 1}


def test_a_compacted_revision_is_read_again(
    relayed: tuple[Relay, EtcdClient], etcd_client: EtcdClient, key_prefix: str
) -> None:
    relay, client = relayed
    key = key_prefix + "k"
    etcd_client.put(key, b"0")
    spied = Spied(client)
    seen = Seen()
    follower = KeyFollower(client, key, seen, retry_pause=timedelta(seconds=0.1)).start()
    try:
        seen.wait_for(lambda events: len(events) == 1)
        etcd_client.put(key, b"1")
        seen.wait_for(lambda events: len(events) == 2)

        relay.cut()
        assert spied.ended.wait(WAIT)
        for i in range(2, 6):
            etcd_client.put(key, str(i).encode())
        etcd_client.compact()  # the revisions to resume from are gone
        relay.restore()
        seen.wait_for(lambda events: len(events) == 3)
        etcd_client.put(key, b"6")
        seen.wait_for(lambda events: len(events) == 4)
    finally:
        follower.stop()
        assert follower.join(WAIT)
    # what was stored after the compaction stands for the writes it dropped
    assert seen.values() == [b"0", b"1", b"5", b"6"]
    assert spied.reads == 2  # the first start, and after the compaction


def test_a_follower_without_values_only_learns_where_to_start(
    etcd_client: EtcdClient, key_prefix: str
) -> None:
    etcd_client.put(key_prefix + "old", b"x")
    seen = Seen()
    reads = threading.Semaphore(0)
    follower = KeyFollower(
        etcd_client, key_prefix, seen, prefix=True, values=False, on_read=reads.release
    ).start()
    try:
        assert reads.acquire(timeout=WAIT)
        etcd_client.put(key_prefix + "new", b"y")
        seen.wait_for(lambda events: len(events) == 1)
    finally:
        follower.stop()
        assert follower.join(WAIT)
    assert [e.key for e in seen.events] == [key_prefix + "new"]


def test_stop_ends_a_follower_waiting_for_events(etcd_client: EtcdClient, key_prefix: str) -> None:
    reads = threading.Semaphore(0)
    follower = KeyFollower(etcd_client, key_prefix + "quiet", Seen(), on_read=reads.release).start()
    assert reads.acquire(timeout=WAIT)
    follower.stop()
    assert follower.join(WAIT)
