"""The members of an etcd cluster as one client sees them: a channel each, and which to use.

The etcd3 library fails over (``MultiEndpointEtcd3Client(failover=True)``)
with one set of stubs shared by every endpoint, and when a call fails it marks
as failed whichever endpoint is in use *at that moment*, not the one the call
went to.  With several threads, a call that fails late on a member that died
marks the live member the client had already moved to; the endpoints are then
walked in their configured order, so a dead member listed first is tried again
each time its one-second ban is over.  Here members are kept apart:

* each member has its own channel, stubs and watcher (:class:`MemberClient`:
  the library's client of that one endpoint, whose own fail-over bookkeeping
  is turned off);
* :class:`Members` knows which member calls go to (``current``) and when each
  member last failed a call.  A failure moves the client off the member that
  failed, not off another, to the next member that has not failed lately; the
  client stays there while it answers;
* a member that failed is avoided for :data:`AVOID_FIRST`, doubling with each
  failure in a row up to :data:`AVOID_MAX`, and tried again afterwards when a
  call needs another member (a member that came back is used again).

Every attempt of a call has its own gRPC deadline (:func:`attempt_timeout`),
shorter than the call's: a write that a member forwarded to a leader that has
just died is never answered (etcd gives up on it after 5 s plus two election
timeouts), and is sent again instead of waiting for that.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import etcd3
import etcd3.exceptions as etcd_exc
import grpc
from etcd3 import etcdrpc
from etcd3 import watch as etcd_watch

#: How long a member that failed a call is avoided (doubling with each failure in a row).
AVOID_FIRST = timedelta(seconds=1)
#: The longest a member is avoided before it is tried again.
AVOID_MAX = timedelta(seconds=30)

#: gRPC's reconnect back-off of a member's channel is capped at this, so a
#: member that came back is reachable again within it (gRPC's default cap is
#: 120 s, and calls fail at once while a channel waits to reconnect).
RECONNECT_MAX = timedelta(seconds=1)

#: etcd's limit on one request (its ``--max-request-bytes`` default, 1.5 MiB): a
#: put or transaction larger than this is refused with "request is too large".
#: The client refuses such a write itself, naming the key (``EtcdClient.put``).
MAX_REQUEST_BYTES = 1536 * 1024
#: gRPC limit on what a client sends: etcd's own gRPC limit on what it receives
#: (``--max-request-bytes`` + 512 KiB).  A backstop: requests are checked against
#: :data:`MAX_REQUEST_BYTES` before they are sent.
MAX_SEND_MESSAGE_BYTES = MAX_REQUEST_BYTES + 512 * 1024
#: gRPC limit on one answer (gRPC's default is 4 MiB).  Range reads are paged to
#: about 1 MiB (``orchestrator.etcd.ranges.PAGE_BYTES``), so this only leaves
#: room for a page of keys that are each near etcd's 1.5 MiB limit; a larger
#: answer is asked for again in smaller pages.
MAX_RECEIVE_MESSAGE_BYTES = 16 * 1024 * 1024

CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", int(RECONNECT_MAX.total_seconds() * 1000)),
    ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
)

# How the etcd3 library turns gRPC status codes into its exceptions (its own table).
_LIBRARY_ERRORS: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.INTERNAL: etcd_exc.InternalServerError,
    grpc.StatusCode.UNAVAILABLE: etcd_exc.ConnectionFailedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: etcd_exc.ConnectionTimeoutError,
    grpc.StatusCode.FAILED_PRECONDITION: etcd_exc.PreconditionFailedError,
}

_local = threading.local()


@contextlib.contextmanager
def attempt_timeout(seconds: float) -> Iterator[None]:
    """Calls this thread makes through a :class:`MemberClient` meanwhile get this deadline."""
    previous = getattr(_local, "timeout", None)
    _local.timeout = seconds
    try:
        yield
    finally:
        _local.timeout = previous


def _timeout(default: float | None) -> float | None:
    override: float | None = getattr(_local, "timeout", None)
    return override if override is not None else default


class _Watcher(etcd_watch.Watcher):
    """The library's watcher, waiting for a new watch as long as the current attempt allows."""

    @property
    def timeout(self) -> float | None:
        return _timeout(self._default_timeout)

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._default_timeout = value

    def _run(self) -> None:
        # A client closed just after its first watch was made can close the channel
        # before this thread opens the stream: the call then raises ValueError
        # ("Cannot invoke RPC: Channel closed!"), which the library does not catch (a
        # gRPC error it does).  The library's ``finally`` has told the callbacks that
        # the stream ended; nothing is left to watch.
        with contextlib.suppress(ValueError):
            super()._run()

    def _handle_response(self, rs: Any) -> None:
        super()._handle_response(rs)
        if rs.created and rs.compact_revision != 0:
            # The library records a watch refused for a compacted start revision
            # but wakes no one: the caller would wait out its whole deadline.
            with self._lock:
                self._new_watch_cond.notify_all()


class MemberClient(etcd3.MultiEndpointEtcd3Client):
    """The etcd3 library's client of one member, without the library's fail-over.

    :class:`Members` decides where calls go.  gRPC errors become the library's
    exceptions as before (with the gRPC error as their cause), but do not mark
    the endpoint failed or drop the stubs: the channel is this member's for
    good, and its watcher keeps serving the watches opened on it.  The gRPC
    deadline of a call is the current attempt's (:func:`attempt_timeout`), or
    ``timeout`` outside an attempt.
    """

    @property
    def timeout(self) -> float | None:
        return _timeout(self._default_timeout)

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._default_timeout = value

    def get_watcher(self) -> Any:
        return _Watcher(
            etcdrpc.WatchStub(self.channel),
            timeout=self._default_timeout,
            call_credentials=self.call_credentials,
            metadata=self.metadata,
        )

    def _manage_grpc_errors(self, exc: grpc.RpcError) -> None:
        error = _LIBRARY_ERRORS.get(exc.code())
        if error is None:
            raise exc
        raise error() from exc


def member_client(host: str, port: int, creds: Any, timeout: float) -> MemberClient:
    """A client of the member at ``host:port`` (no connection is made yet)."""
    endpoint = etcd3.Endpoint(
        host,
        port,
        secure=creds is not None,
        creds=creds,
        time_retry=0.0,  # the library's own ban on a failed endpoint: never
        opts=list(CHANNEL_OPTIONS),
    )
    return MemberClient(endpoints=[endpoint], timeout=timeout, failover=False)


@dataclass(eq=False)
class Member:
    """One member: its endpoint, its client and how it has been answering."""

    endpoint: str
    raw: Any
    #: failures in a row (0 once it answers)
    failures: int = 0
    #: ``time.monotonic()`` until which calls go elsewhere if they can
    avoid_until: float = 0.0
    #: the error of its last failure, for messages
    last_error: Exception | None = None
    #: an auth token was obtained from this member (user/password auth)
    authenticated: bool = False


@dataclass(eq=False)
class Members:
    """The members a client talks to, the one in use, and when each last failed."""

    members: list[Member]
    _current: int = 0
    #: how many times calls moved to another member
    switches: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of_one(cls, raw: Any, endpoint: str = "etcd") -> Members:
        return cls([Member(endpoint, raw)])

    @property
    def current(self) -> Member:
        return self.members[self._current]

    def pick(self, tried: Collection[Member] = ()) -> Member | None:
        """The member for the next attempt of a call that already tried ``tried``.

        The current member unless it was tried or is being avoided; else the
        next one after it that is not avoided; else, if every one left is
        avoided, the one whose avoidance ends first.  None when every member
        has been tried.
        """
        with self._lock:
            now = time.monotonic()
            current = self.current
            if current not in tried and current.avoid_until <= now:
                return current
            return self._best(now, tried)

    def failed(self, member: Member, error: Exception | None) -> None:
        """``member`` did not serve a call: avoid it, and move off it if it is in use."""
        with self._lock:
            now = time.monotonic()
            member.failures += 1
            member.last_error = error
            avoid = AVOID_FIRST.total_seconds() * 2 ** min(member.failures - 1, 16)
            member.avoid_until = now + min(avoid, AVOID_MAX.total_seconds())
            if member is self.current:
                other = self._best(now, (member,))
                if other is not None:
                    self._move_to(other)

    def answered(self, member: Member) -> None:
        """``member`` served a call; it becomes the one in use if that one is avoided."""
        with self._lock:
            member.failures = 0
            member.avoid_until = 0.0
            member.last_error = None
            if member is not self.current and self.current.avoid_until > time.monotonic():
                self._move_to(member)

    def close(self) -> None:
        for m in self.members:
            with contextlib.suppress(Exception):
                m.raw.close()

    def _best(self, now: float, tried: Collection[Member]) -> Member | None:
        n = len(self.members)
        after = [self.members[(self._current + k) % n] for k in range(1, n + 1)]
        left = [m for m in after if m not in tried]
        if not left:
            return None
        for m in left:
            if m.avoid_until <= now:
                return m
        return min(left, key=lambda m: m.avoid_until)

    def _move_to(self, member: Member) -> None:
        index = self.members.index(member)
        if index != self._current:
            self._current = index
            self.switches += 1


def start_at(count: int) -> int:
    """Where a new client starts in its endpoint list: at random, so clients spread out."""
    return random.randrange(count) if count > 1 else 0
