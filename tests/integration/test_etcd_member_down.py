"""One etcd member down is invisible to a client (a real three-member cluster).

* The member a client uses is SIGKILLed while three threads of it make calls:
  the client fails over once, to a live member, and stays there (the dead
  member is not tried again while that one answers); every call answers
  quickly and ``unreachable_for()`` stays below the contact timeout.  When the
  member comes back, calls go on.
* The raft leader is SIGKILLed while a client writes through a follower: a
  write the follower forwarded to the dead leader is sent again at the
  attempt's deadline instead of after etcd's own request timeout (7 s here),
  and etcd does not count as unreachable meanwhile (a majority of the members
  answer).  Only two members down is an outage.

The tests wait for events (calls answered, every caller past the fail-over),
not for fixed sleeps, so a loaded machine slows them down without failing
them; and every test starts with all three members up, whatever the test
before it left (a test that failed before restarting its member used to leave
the next one a two-member cluster, where killing the leader is an outage).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from etcd3 import etcdrpc

from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.options import EtcdOptions
from orchestrator.settings import SETTINGS
from tests.faults.etcd_cluster import EtcdCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

#: A worker pauses when ``unreachable_for()`` exceeds this.
CONTACT = SETTINGS.etcd_contact_timeout.total_seconds()
#: A call that waited for the whole operation timeout did not fail over: no call
#: may take more than a fifth of it (a loaded machine slows calls, not this much).
PROMPT = SETTINGS.etcd_op_timeout.total_seconds() / 5
#: How long a test waits for an event (calls answered, a member back).
EVENT_TIMEOUT = 60.0
#: etcd's own answer to a write lost with its leader: 5 s plus two election timeouts.
ETCD_REQUEST_TIMEOUT = 7.0
PREFIX = "/ringmaster/test-member-down/"


@pytest.fixture(scope="module")
def whole_cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


@pytest.fixture
def cluster(whole_cluster: EtcdCluster) -> EtcdCluster:
    """The module's cluster with every member up and healthy, whatever a test before left."""
    for i in range(len(whole_cluster.members)):
        whole_cluster.restart(i)  # no-op for a running member
    whole_cluster.wait_healthy()
    return whole_cluster


def _leader(client: EtcdClient) -> int:
    """Index of the member that is the raft leader."""
    for i, m in enumerate(client.members.members):
        status = m.raw.maintenancestub.Status(etcdrpc.StatusRequest(), 2)
        if status.leader == status.header.member_id:
            return i
    raise AssertionError("no member is the leader")


def _use(client: EtcdClient, index: int) -> None:
    """Make the client's calls go to member ``index`` (no switch counted)."""
    members = client.members
    members._move_to(members.members[index])
    members.switches = 0


class Load:
    """Threads that call etcd through one client, and one that samples ``unreachable_for()``."""

    def __init__(self, client: EtcdClient, calls: dict[str, Callable[[int], object]]) -> None:
        self.client = client
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.slowest = 0.0
        self.unreachable = 0.0
        self.answered = 0
        self._changed = threading.Condition()
        #: per caller: when its last finished call had started
        self._last_started: dict[str, float] = dict.fromkeys(calls, -1.0)
        self._threads = [
            threading.Thread(target=self._calls, args=(name, fn), daemon=True)
            for name, fn in calls.items()
        ]
        self._threads.append(threading.Thread(target=self._sample, daemon=True))

    def _calls(self, name: str, fn: Callable[[int], object]) -> None:
        i = 0
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                fn(i)
                ok = True
            except Exception as e:  # every failure is a finding
                self.errors.append(f"{name} #{i}: {type(e).__name__}: {e}")
                ok = False
            with self._changed:
                self.answered += ok
                self.slowest = max(self.slowest, time.monotonic() - started)
                self._last_started[name] = started
                self._changed.notify_all()
            i += 1
            self.stop.wait(0.02)

    def _sample(self) -> None:
        while not self.stop.wait(0.02):
            self.unreachable = max(self.unreachable, self.client.unreachable_for())

    def wait_answered(self, more: int) -> None:
        """Wait until ``more`` calls were answered from now on."""
        with self._changed:
            target = self.answered + more
            assert self._changed.wait_for(lambda: self.answered >= target, EVENT_TIMEOUT), (
                f"{target - self.answered} of {more} calls not answered in {EVENT_TIMEOUT:g}s; "
                f"errors: {self.errors[:5]}"
            )

    def wait_every_caller_past(self, moment: float) -> None:
        """Wait until every caller has finished a call it started after ``moment``.

        A call started before then (on the member in use then) has ended by
        now, in an answer or a failure.
        """
        with self._changed:
            assert self._changed.wait_for(
                lambda: min(self._last_started.values()) > moment, EVENT_TIMEOUT
            ), f"a caller made no call in {EVENT_TIMEOUT:g}s; errors: {self.errors[:5]}"

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(15)


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + EVENT_TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {EVENT_TIMEOUT:g}s"
        time.sleep(0.01)


def test_the_member_in_use_down_the_client_fails_over_once_and_stays(
    cluster: EtcdCluster,
) -> None:
    with connect(EtcdOptions(cluster.endpoints)) as client:
        victim = (_leader(client) + 1) % 3  # a follower: writes are never lost with it
        _use(client, victim)
        members = client.members
        dead = members.members[victim]
        calls = {
            "put": lambda i: client.put(PREFIX + "a", str(i)),
            "get": lambda i: client.get(PREFIX + "a"),
            "txn": lambda i: client.compare_and_set(PREFIX + f"b{i}", "x", None),
        }
        with Load(client, calls) as load:
            load.wait_answered(10)
            cluster.kill(victim)
            _wait_for(lambda: members.switches >= 1, "the client failing over")
            # calls that had picked the dead member before the switch end, one way or
            # the other; from then on it must not be tried again
            load.wait_every_caller_past(time.monotonic())
            failures_after_failover = dead.failures
            load.wait_answered(60)
        assert not load.errors, load.errors[:5]
        assert members.switches == 1, "the client failed over more than once"
        assert members.current is not dead
        assert 1 <= dead.failures <= len(calls)  # calls in flight when it died, no more
        assert dead.failures == failures_after_failover, "the dead member was tried again"
        assert load.slowest < PROMPT, f"a call took {load.slowest:.2f}s"
        assert load.unreachable < CONTACT / 2, f"unreachable for {load.unreachable:.2f}s"

        cluster.restart(victim)
        cluster.wait_healthy()
        with Load(client, calls) as load:
            load.wait_answered(30)
        assert not load.errors, load.errors[:5]
        assert members.switches == 1
        assert load.unreachable < CONTACT / 2


def test_the_leader_down_writes_go_on_and_etcd_is_not_unreachable(
    cluster: EtcdCluster,
) -> None:
    with connect(EtcdOptions(cluster.endpoints)) as client:
        leader = _leader(client)
        _use(client, (leader + 1) % 3)
        members = client.members
        calls = {
            "put": lambda i: client.put(PREFIX + "c", str(i)),
            "put2": lambda i: client.put(PREFIX + "d", str(i)),
        }
        with Load(client, calls) as load:
            load.wait_answered(10)
            cluster.kill(leader)
            killed = time.monotonic()
            # a new leader is elected and every writer's calls go through it
            load.wait_every_caller_past(killed)
            load.wait_answered(40)
        assert not load.errors, load.errors[:5]
        # lost writes were sent again well before etcd itself would have answered
        assert load.slowest < ETCD_REQUEST_TIMEOUT / 2, f"a write took {load.slowest:.2f}s"
        assert load.unreachable < CONTACT, f"unreachable for {load.unreachable:.2f}s"
        assert members.members[leader] is not members.current
