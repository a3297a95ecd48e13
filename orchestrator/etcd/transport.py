"""How every etcd call travels: fail-over between members, retries, and etcd's outages.

:class:`EtcdTransport` runs one call of the ``etcd3`` library (installed from
the ``cslab-etcd3`` distribution) at a time for the key-value facade
(:class:`~orchestrator.etcd.client.EtcdClient`), in whichever process holds
the client (the controller, a node agent, a worker, the CLI):

* Calls fail over between members and are retried for up to the operation
  timeout when a member does not serve them (:mod:`orchestrator.etcd.members`):
  the transport moves off the member that failed, stays on one that answers,
  and tries a failed member again only later; every attempt has a deadline of
  its own (``EtcdOptions.attempt_timeout``), so a write lost with a leader
  that died is sent again within it.  A single member going down is invisible
  to callers.
* It keeps the outage bookkeeping: how long etcd kept its calls waiting
  (:attr:`EtcdTransport.last_silence`) and whether etcd is reachable with a
  quorum at all (:meth:`EtcdTransport.unreachable_for`).  A write etcd
  refuses for want of space (its NOSPACE alarm) counts as etcd being away
  until a write goes through again.
* Refusals that are not an outage become named errors
  (:mod:`orchestrator.etcd.diagnosis`).
* With user/password, an auth token the server no longer knows (another
  member, expiry) is renewed once.  Passwords never appear in messages, logs
  or ``repr``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import grpc

from orchestrator.api import EtcdAuthError, EtcdError, EtcdUnavailableError
from orchestrator.etcd import channel, diagnosis
from orchestrator.etcd import quorum as quorum_mod
from orchestrator.etcd.diagnosis import EtcdNoSpaceError
from orchestrator.etcd.members import Member, Members, attempt_timeout
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.quorum import QuorumProbe
from orchestrator.etcd.retry import Backoff

__all__ = [
    "PROBE_AFTER",
    "RETRY_PAUSES",
    "SILENCE_THRESHOLD",
    "EtcdTransport",
    "stub_call",
]

T = TypeVar("T")

#: A gap this long between two answered calls of a busy client is an etcd outage
#: (or a stall) as far as that client can tell: see ``EtcdTransport.last_silence``.
SILENCE_THRESHOLD = timedelta(seconds=2)
#: Pauses between rounds of attempts of one call over every member (jittered,
#: doubling up to the second).
RETRY_PAUSES = (timedelta(seconds=0.1), timedelta(seconds=0.5))
#: A call waiting or failing this long makes :meth:`EtcdTransport.unreachable_for`
#: ask the members whether etcd has a quorum (:mod:`orchestrator.etcd.quorum`).
PROBE_AFTER = timedelta(seconds=0.5)


class EtcdTransport:
    """Runs calls of the etcd3 library on the members, with fail-over and retries.

    Built by :func:`~orchestrator.etcd.client.connect` inside the client;
    reach it as ``client.transport`` to make a call the facade has no method for.

    Args:
        options: endpoints, credentials and timeouts.
        raw: the members to talk to (:class:`~orchestrator.etcd.members.Members`),
            or one raw client of the etcd3 library (tests).
    """

    def __init__(self, options: EtcdOptions, raw: Any) -> None:
        self.options = options
        self._members = raw if isinstance(raw, Members) else Members.of_one(raw)
        self._auth_lock = threading.Lock()
        #: ``time.monotonic()`` of the last time etcd showed it had a quorum: a call
        #: it answered (other than watch creation or status), or a quorum probe.
        self.last_success = time.monotonic()
        #: ``(monotonic end, seconds)`` of the last time etcd kept this client's
        #: calls waiting or failing for longer than :data:`SILENCE_THRESHOLD`: an
        #: outage or a stall of etcd, during which leases may have expired for
        #: reasons of etcd's own.
        self.last_silence: tuple[float, float] | None = None
        self._waiting: dict[int, float] = {}  # call id -> start, ordinary calls in flight
        self._ids = itertools.count()
        self._failing_since: float | None = None
        #: ``time.monotonic()`` of the first write etcd refused for want of space
        #: (NOSPACE) since the last write it took; None when writes go through.
        self._no_space_since: float | None = None
        self._probe = QuorumProbe(self._members, self._in_trouble, self._quorum_seen)

    @property
    def raw(self) -> Any:
        """The etcd3 library's client of the member calls go to now."""
        return self._members.current.raw

    @property
    def members(self) -> Members:
        """The members, the one in use, and how each has been answering."""
        return self._members

    def _record_silence(self, end: float, seconds: float) -> None:
        """Record a silence, unless it lies inside the one recorded already.

        Calls that were started during an outage end one after another once
        etcd answers again; the first answer ends the outage, and a later,
        shorter wait that overlaps it is the same outage, not a new one.
        """
        previous = self.last_silence
        if previous is not None and end - seconds < previous[0] and seconds <= previous[1]:
            return
        self.last_silence = (end, seconds)

    def _trouble_since(self) -> float | None:
        """Since when a call has been waiting or failing; None when none is."""
        starts = list(self._waiting.values())
        failing = self._failing_since
        if failing is not None:
            starts.append(failing)
        return min(starts, default=None)

    def unreachable_for(self) -> float:
        """How long etcd has been away for this client (0: all is well).

        Counts from the oldest ordinary call still in flight, or the first call
        that failed since the last answer, so an idle client is not
        "unreachable"; and only from the last time etcd showed it has a quorum
        since then.  A call kept waiting by one member (down, or forwarding a
        write to a leader that has just died) while the others keep a quorum
        is not etcd being away: once a call has waited :data:`PROBE_AFTER`,
        the members are asked in the background (:class:`QuorumProbe`), and a
        majority of them answering, with a leader, is etcd being there.

        etcd refusing writes for want of space (its NOSPACE alarm) is etcd
        being away too, from the first write it refused until one goes through
        again (or the alarms are found gone: :meth:`end_no_space`): reads still work, but
        nothing can be recorded, fenced or planned.
        """
        now = time.monotonic()
        no_space = self._no_space_since
        away = 0.0 if no_space is None else max(now - no_space, 0.0)
        trouble = self._trouble_since()
        if trouble is None:
            return away
        if now - trouble > PROBE_AFTER.total_seconds():
            self._probe.want()
        return max(now - max(trouble, self.last_success), away, 0.0)

    def _in_trouble(self) -> bool:
        """A call has been waiting or failing for :data:`PROBE_AFTER` or longer."""
        trouble = self._trouble_since()
        return trouble is not None and time.monotonic() - trouble > PROBE_AFTER.total_seconds()

    def _quorum_seen(self, at: float) -> None:
        """A :class:`QuorumProbe` found, at ``at``, that etcd has a quorum."""
        self.last_success = max(self.last_success, at)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.options.endpoints

    def close(self) -> None:
        """Stop the quorum probe and close every member's channel."""
        self._probe.close()
        self._members.close()

    # -- calls -------------------------------------------------------------------------

    def call(
        self,
        fn: Callable[[Any], T],
        timeout: timedelta | None = None,
        *,
        quorum: bool = True,
        write: bool = False,
        what: str = "",
    ) -> T:
        """Run ``fn(raw_client)``; on connection errors fail over and retry until the deadline.

        ``quorum=False``: an answer does not show that etcd has a quorum (a watch
        is created, a status served, by a member alone).  ``write``: the call
        writes (a put, a transaction with one, a lease grant), which etcd
        refuses while its NOSPACE alarm is raised.  ``what`` names the request
        in messages (`` writing /ringmaster/...``).

        Raises:
            EtcdNoSpaceError: a write refused for want of space (not retried).
            EtcdRequestTooLargeError: etcd refused the request for its size.
            EtcdResponseTooLargeError: the answer was over the gRPC receive limit.
            EtcdCompactedError: a read at a revision etcd has compacted away.
        """
        started = time.monotonic()
        deadline = started + (timeout or self.options.op_timeout).total_seconds()
        call_id = next(self._ids)
        if timeout is None:  # long waits (watch-once) are not a sign of trouble
            self._waiting[call_id] = started
        try:
            result = self._attempt(fn, deadline, started, timeout, quorum=quorum, what=what)
        except EtcdNoSpaceError:
            if write and self._no_space_since is None:
                self._no_space_since = started
            raise
        finally:
            self._waiting.pop(call_id, None)
        if write:
            self.end_no_space()
        return result

    def end_no_space(self) -> None:
        """etcd takes writes again (a write went through, or no NOSPACE alarm is raised).

        A NOSPACE alarm that lasted is a silence (:attr:`last_silence`), as an
        outage is (the controller pauses the job for it).
        """
        since, self._no_space_since = self._no_space_since, None
        if since is None:
            return
        now = time.monotonic()
        if now - since > SILENCE_THRESHOLD.total_seconds():
            self._record_silence(now, now - since)

    def _attempt(
        self,
        fn: Callable[[Any], T],
        deadline: float,
        started: float,
        timeout: timedelta | None,
        *,
        quorum: bool = True,
        what: str = "",
    ) -> T:
        """Attempts of one call: on each member in turn, then again after a pause.

        A member that does not serve an attempt (unreachable, no leader, past
        the attempt's deadline) is left for the next one at once; only once
        every member has failed this call does it pause (jittered, doubling),
        and the attempts of the next round get twice the deadline.  The first
        failure that may mean the raft leader is gone (the attempt ran out of
        time, "request timed out", "leader changed") sends the next attempt to
        the new leader once one is elected (:func:`~orchestrator.etcd.quorum.find_leader`).
        """
        last: Exception | None = None
        renewed: set[Member] = set()
        backoff: Backoff | None = None
        tried: set[Member] = set()
        rounds = 0
        leader: Member | None = None  # where to send the next attempt, once found
        looked_for_leader = False
        while True:
            member, leader = leader or self._members.pick(tried), None
            if member is None:  # every member failed this call: pause, then go round again
                now = time.monotonic()
                if now >= deadline:
                    raise self._unavailable(timeout, last) from last
                backoff = backoff or Backoff(*RETRY_PAUSES)
                time.sleep(min(backoff.next(), deadline - now))
                tried.clear()
                rounds += 1
                continue
            tried.add(member)
            attempt_started = time.monotonic()
            try:
                with attempt_timeout(self._attempt_seconds(rounds, deadline)):
                    self.authenticate(member)
                    result = fn(member.raw)
            except diagnosis.RETRYABLE as e:
                last = e
            except grpc.RpcError as e:
                if diagnosis.token_rejected(e) and self.options.user and member not in renewed:
                    renewed.add(member)  # the member does not know the token: get a new one
                    member.authenticated = False
                    tried.discard(member)
                    continue
                refused = diagnosis.auth_refusal(e, self.endpoints, self.options.user)
                if refused is not None:
                    raise refused from e
                named = diagnosis.refusal(e, self.endpoints, what)
                if named is not None:
                    raise named from e
                if not diagnosis.transient(e):
                    raise EtcdError(f"etcd error {e.code().name}: {e.details()}") from e
                last = e
            else:
                self._members.answered(member)
                if quorum:
                    now = time.monotonic()
                    # Silence is etcd keeping calls waiting or failing, not a gap between
                    # calls: a process that was idle or starved of CPU saw no outage.
                    # (A call with its own timeout is a long wait by design: only its
                    # failures count.)
                    self._answered(started if timeout is None else now, now)
                return result
            self._members.failed(member, last)
            if self._failing_since is None:
                self._failing_since = started if timeout is None else attempt_started
            if time.monotonic() >= deadline:
                raise self._unavailable(timeout, last) from last
            if not looked_for_leader and diagnosis.leader_trouble(last):
                # The write may have gone to a leader that died, through a member that
                # still takes it for the leader: once a new leader is elected, send it
                # there (a follower may not know yet, and lose it again).  Once a call.
                looked_for_leader = True
                until = min(deadline, time.monotonic() + self._attempt_seconds(rounds, deadline))
                found = quorum_mod.find_leader(self._members, until)
                leader = found if found is not member else None

    def _attempt_seconds(self, rounds: int, deadline: float) -> float:
        """The deadline of an attempt in round ``rounds`` (0 first), within the call's."""
        first = min(self.options.attempt_timeout, self.options.op_timeout).total_seconds()
        remaining = deadline - time.monotonic()
        return max(min(first * 2 ** min(rounds, 8), remaining), 0.05)

    def _answered(self, since: float, now: float) -> None:
        """etcd answered, at ``now``, a call that had waited since ``since``: it has a quorum."""
        failing = self._failing_since
        if failing is not None:
            since = min(since, failing)
        waited = now - since
        if waited > SILENCE_THRESHOLD.total_seconds():
            self._record_silence(now, waited)
        self.last_success = max(self.last_success, now)
        self._failing_since = None

    def _unavailable(
        self, timeout: timedelta | None, last: Exception | None
    ) -> EtcdUnavailableError:
        reasons = {
            m.endpoint: diagnosis.describe_endpoint(m.endpoint, m.last_error or last)
            for m in self._members.members
        }
        return EtcdUnavailableError(
            list(self.endpoints), timeout or self.options.op_timeout, reasons
        )

    def authenticate(self, member: Member) -> None:
        """Get ``member`` an auth token if it has none (user/password auth).

        For calls made on one member on purpose (defragmenting it); :meth:`call`
        does it for every attempt.
        """
        if not self.options.user or member.authenticated:
            return
        with self._auth_lock:
            if member.authenticated:
                return
            try:
                channel.authenticate(member.raw, self.options)
            except grpc.RpcError as e:
                if e.code() not in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.INVALID_ARGUMENT,
                ):
                    raise  # unreachable, no leader...: the attempt fails over
                raise EtcdAuthError(
                    f"etcd at {member.endpoint} refused user {self.options.user!r}: "
                    f"{e.details()}; check --etcd-user and --etcd-password / "
                    "RINGMASTER_ETCD_PASSWORD"
                ) from e
            member.authenticated = True


def stub_call(method: str, request: Any) -> Callable[[Any], Any]:
    """A call of the KV stub's ``method`` with ``request``, made the way the etcd3 library does.

    For requests the library cannot build (range reads in a transaction at a
    given revision, a delete of a key range): same deadline, credentials and
    metadata, and gRPC errors turned into the library's exceptions.
    """

    def call(raw: Any) -> Any:
        try:
            return getattr(raw.kvstub, method)(
                request, raw.timeout, credentials=raw.call_credentials, metadata=raw.metadata
            )
        except grpc.RpcError as e:
            manage = getattr(raw, "_manage_grpc_errors", None)
            if manage is not None:
                manage(e)
            raise

    return call
