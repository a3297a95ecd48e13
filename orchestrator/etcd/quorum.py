"""Whether etcd has a quorum, asked of the members while a call of a client waits.

A call can wait on one member while etcd is fine: the member is down (the
call fails over at once, or at its attempt's deadline), or its leader has
just died and took the write it forwarded with it (etcd answers such a write
only after 5 s and two election timeouts; the client sends it again at the
attempt's deadline).  Counting such a wait as etcd being away would pause a
job for one member down.  So :class:`QuorumProbe` asks every member for its
status (served by the member alone, at once) and counts etcd as there when a
majority of the members answer and one of them knows a leader:

* one member of three down, a new leader being elected: two answer, and until
  the election both still name the old leader; there is a quorum;
* two of three down: one answers, a minority; there is none;
* members that the client reaches but that cannot reach each other: they
  soon name no leader (a leader that hears from no quorum steps down); none.

It runs in a thread of its own, only for a client that asks whether etcd is
away (:meth:`~orchestrator.etcd.client.EtcdClient.unreachable_for`), and only
while that client keeps asking and a call keeps waiting or failing; after a
round without a quorum the pause before the next grows (jittered, doubling),
so a cluster without a quorum is not flooded by every client at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc
from etcd3 import etcdrpc

from orchestrator.etcd import diagnosis
from orchestrator.etcd.members import Member, Members
from orchestrator.etcd.retry import Backoff

#: Pauses between two rounds while a call keeps waiting (jittered, doubling after
#: each round without a quorum).
PROBE_PAUSES = (timedelta(seconds=0.2), timedelta(seconds=2))
#: Deadline of one member's status in a round.
PROBE_TIMEOUT = timedelta(seconds=0.5)
#: Rounds go on this long after the client last asked.
WANTED_FOR = timedelta(seconds=2)
#: Pauses between two rounds of :func:`find_leader` (jittered, doubling): an
#: election takes about one to two election timeouts.
LEADER_POLL = (timedelta(seconds=0.05), timedelta(seconds=0.4))


class QuorumProbe:
    """Asks the members, in the background, whether etcd has a quorum.

    Args:
        members: the client's members.
        needed: whether a call still waits or fails (the rounds stop when not).
        seen: called with ``time.monotonic()`` whenever a round found a quorum.
    """

    def __init__(
        self, members: Members, needed: Callable[[], bool], seen: Callable[[float], None]
    ) -> None:
        self._members = members
        self._needed = needed
        self._seen = seen
        self._wanted = threading.Event()
        self._wanted_at = 0.0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def want(self) -> None:
        """Start rounds now (they go on while wanted and needed)."""
        if self._closed.is_set():
            return
        self._wanted_at = time.monotonic()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="etcd-quorum-probe", daemon=True
                )
                self._thread.start()
        self._wanted.set()

    def close(self) -> None:
        self._closed.set()
        self._wanted.set()

    def _loop(self) -> None:
        while not self._closed.is_set():
            self._wanted.wait()
            self._wanted.clear()
            pauses = Backoff(*PROBE_PAUSES)
            while not self._closed.is_set() and self._going_on():
                if self.probe_once():  # the evidence must stay fresh while calls wait
                    pauses = Backoff(*PROBE_PAUSES)
                self._closed.wait(pauses.next())

    def _going_on(self) -> bool:
        recently = time.monotonic() - self._wanted_at < WANTED_FOR.total_seconds()
        return recently and self._needed()

    def probe_once(self) -> bool:
        """One round: every member's status at once; True (and ``seen``) on a quorum."""
        statuses = poll_status(self._members, PROBE_TIMEOUT)
        answered = [st for st in statuses.values() if st is not None]
        if 2 * len(answered) > len(self._members.members) and any(st.leader for st in answered):
            self._seen(time.monotonic())
            return True
        return False


def poll_status(members: Members, timeout: timedelta) -> dict[Member, Any]:
    """Every member's status, asked at once: ``None`` for a member that did not answer.

    A member found down (not merely slow) is marked failed, so calls skip it.
    """
    pending: list[tuple[Member, Any]] = []
    for m in members.members:
        try:
            future = m.raw.maintenancestub.Status.future(
                etcdrpc.StatusRequest(), timeout=timeout.total_seconds(), metadata=m.raw.metadata
            )
        except Exception:  # not a client of the etcd3 library (tests): no answer
            future = None
        pending.append((m, future))
    out: dict[Member, Any] = {}
    for m, future in pending:
        out[m] = None
        if future is None:
            continue
        try:
            out[m] = future.result()  # bounded by the call's own deadline
        except grpc.RpcError as e:
            if diagnosis.member_down(e):
                members.failed(m, e)
        except Exception:
            pass
    return out


def find_leader(members: Members, until: float) -> Member | None:
    """The member that is the raft leader (it says so itself), asking until ``until``.

    A write sent to a follower that still takes a dead member for its leader
    is forwarded there and lost; sent to the leader itself, it is not.
    """
    pauses = Backoff(*LEADER_POLL)
    while True:
        remaining = until - time.monotonic()
        timeout = timedelta(seconds=min(max(remaining, 0.05), PROBE_TIMEOUT.total_seconds()))
        for m, st in poll_status(members, timeout).items():
            if st is not None and st.leader and st.leader == st.header.member_id:
                return m
        pause = pauses.next()
        if time.monotonic() + pause >= until:
            return None
        time.sleep(pause)
