"""Which member an etcd client's calls go to, and when etcd counts as having a quorum.

No etcd is needed: the members' clients are stand-ins and the clock is given.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from orchestrator.etcd import members as members_mod
from orchestrator.etcd.members import AVOID_FIRST, AVOID_MAX, Member, Members
from orchestrator.etcd.quorum import QuorumProbe, find_leader

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(members_mod, "time", SimpleNamespace(monotonic=c))
    return c


def three(current: int = 0) -> Members:
    return Members([Member(f"m{i}:2379", raw=None) for i in range(3)], _current=current)


def test_a_failure_moves_off_that_member_once_and_calls_stay(clock: Clock) -> None:
    ms = three()
    a, b, _ = ms.members
    ms.failed(a, None)
    assert ms.current is b and ms.switches == 1
    for _ in range(5):  # every later call goes to b, which answers
        assert ms.pick() is b
        ms.answered(b)
    clock.now += 3600  # long after a's avoidance: b still answers, so calls stay
    assert ms.pick() is b and ms.switches == 1


def test_a_late_failure_of_a_member_no_longer_in_use_moves_nothing(clock: Clock) -> None:
    ms = three()
    a, b, _ = ms.members
    ms.failed(a, None)  # one thread's call failed on a: the client moves to b
    ms.failed(a, None)  # another thread's call, sent to a before that, fails too
    assert ms.current is b and ms.switches == 1


def test_a_call_tries_each_member_once_per_round(clock: Clock) -> None:
    ms = three(current=1)
    a, b, c = ms.members
    tried: set[Member] = set()
    order = []
    while (m := ms.pick(tried)) is not None:
        tried.add(m)
        order.append(m)
        ms.failed(m, None)
    assert order == [b, c, a]


def test_an_avoided_member_is_tried_again_later_and_avoided_longer(clock: Clock) -> None:
    ms = three()
    a, b, c = ms.members
    ms.failed(a, None)
    assert ms.pick({b, c}) is a  # nothing else left: the dead one is the only try
    clock.now += AVOID_FIRST.total_seconds() / 2
    ms.failed(b, None)  # b fails while a is still avoided: c is next, not a
    assert ms.current is c
    clock.now += AVOID_FIRST.total_seconds()  # a's avoidance is over
    ms.failed(c, None)
    assert ms.current is a  # tried again (b is avoided now)
    ms.failed(a, None)  # still down: avoided twice as long this time
    assert a.avoid_until == pytest.approx(clock.now + 2 * AVOID_FIRST.total_seconds())
    for _ in range(20):
        ms.failed(a, None)
    assert a.avoid_until == pytest.approx(clock.now + AVOID_MAX.total_seconds())
    ms.answered(a)  # back
    assert a.failures == 0 and a.avoid_until == 0.0


def test_when_every_member_is_avoided_the_one_free_first_is_used(clock: Clock) -> None:
    ms = three()
    a, b, c = ms.members
    ms.failed(a, None)
    clock.now += 0.5
    ms.failed(b, None)
    ms.failed(b, None)  # avoided 2 s more
    clock.now += 0.1
    ms.failed(c, None)
    assert ms.pick() is a  # free at +1.0, before b (+2.5) and c (+1.6)
    ms.answered(a)
    assert ms.current is a


class Status:
    """A member's ``Status`` stub: answers ``leader`` or fails with ``code``."""

    def __init__(self, leader: int | None, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.leader = leader
        self.code = code

    def future(self, request: Any, timeout: float, metadata: Any) -> Any:
        return SimpleNamespace(result=self.result)

    def result(self) -> Any:
        if self.leader is None:
            raise RpcError(self.code, "failed to connect to all addresses")
        return SimpleNamespace(leader=self.leader, header=SimpleNamespace(member_id=self.me))

    me = 0


class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def cluster(*leaders: int | None) -> Members:
    return Members(
        [
            Member(
                f"m{i}:2379",
                SimpleNamespace(metadata=None, maintenancestub=SimpleNamespace(Status=Status(x))),
            )
            for i, x in enumerate(leaders)
        ]
    )


@pytest.mark.parametrize(
    ("leaders", "quorum"),
    [
        ((7, 7, 7), True),  # all well
        ((None, 7, 7), True),  # one member down, the others follow the leader
        ((None, 9, 9), True),  # one member down: the leader, the others still name it
        ((None, 0, 9), True),  # ... or are electing a new one
        ((None, None, 9), False),  # two of three down: no quorum, whatever the last one says
        ((0, 0, 0), False),  # every member answers but none knows a leader
    ],
)
def test_a_quorum_is_a_majority_of_members_answering_with_a_leader(
    leaders: tuple[int | None, ...], quorum: bool
) -> None:
    seen: list[float] = []
    ms = cluster(*leaders)
    probe = QuorumProbe(ms, needed=lambda: True, seen=seen.append)
    assert probe.probe_once() is quorum
    assert bool(seen) is quorum
    down = [m for m, x in zip(ms.members, leaders, strict=True) if x is None]
    assert all(m.failures == 1 for m in down)  # calls will skip the members found down


def test_the_leader_is_the_member_that_says_it_leads() -> None:
    ms = cluster(None, 9, 9)
    for i, m in enumerate(ms.members):
        m.raw.maintenancestub.Status.me = 8 + i  # member ids 8, 9, 10
    assert find_leader(ms, until=0.0) is ms.members[1]
    electing = cluster(None, 0, 8)  # the dead member (8) is still taken for the leader
    for i, m in enumerate(electing.members):
        m.raw.maintenancestub.Status.me = 8 + i
    assert find_leader(electing, until=0.0) is None  # one round, no leader
