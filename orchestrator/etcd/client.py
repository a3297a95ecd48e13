"""The etcd client: every etcd call of ringmaster goes through :class:`EtcdClient`.

It wraps the ``etcd3`` v3-API client (installed from the ``cslab-etcd3``
distribution) with what the rest of ringmaster needs and nothing else:

* :func:`connect` tries every endpoint within a connect timeout and fails with
  an :class:`~orchestrator.api.EtcdUnavailableError` naming each endpoint tried
  and why, or at once with an :class:`~orchestrator.api.EtcdAuthError` when
  TLS or the credentials cannot work (:mod:`orchestrator.etcd.diagnosis`).
* Calls fail over between members and are retried for up to the operation
  timeout when a member does not serve them (:mod:`orchestrator.etcd.members`):
  the client moves off the member that failed, stays on one that answers, and
  tries a failed member again only later; every attempt has a deadline of its
  own (``EtcdOptions.attempt_timeout``), so a write lost with a leader that
  died is sent again within it.  A single member going down is invisible to
  callers.  The client records how long etcd kept its calls waiting
  (:attr:`EtcdClient.last_silence`) and tells whether etcd is reachable with a
  quorum at all (:meth:`EtcdClient.unreachable_for`).
* Values are ``bytes`` in, ``bytes`` out; JSON helpers sit on top.
* Compare-and-set on ``mod_revision`` (the primitive rendezvous, leader
  election and fencing are built from), leases, prefix watches.
* For the c10d store: compare-and-set on a value, multi-key reads and writes
  in one transaction, and waits that watch a key from the revision a read saw.
* With user/password, an auth token the server no longer knows (another
  member, expiry) is renewed once.  Passwords never appear in messages, logs
  or ``repr``.

Options are in :mod:`orchestrator.etcd.options`, the values handed out in
:mod:`orchestrator.etcd.kv`, waiting out outages in :mod:`orchestrator.etcd.retry`.
Importing this module sets no environment variable; the gRPC settings of
ringmaster's own processes are in :mod:`orchestrator.etcd.grpc_env`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import etcd3.exceptions as etcd_exc
import grpc

from orchestrator.api import EtcdAuthError, EtcdError, EtcdUnavailableError
from orchestrator.etcd import channel, diagnosis
from orchestrator.etcd import quorum as quorum_mod
from orchestrator.etcd.kv import KeyValue, Lease, Watch, key_value
from orchestrator.etcd.members import Member, Members, attempt_timeout
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.quorum import QuorumProbe
from orchestrator.etcd.retry import Backoff

T = TypeVar("T")

#: Operations per transaction (etcd's default ``--max-txn-ops``).
MAX_TXN_OPS = 128
#: A gap this long between two answered calls of a busy client is an etcd outage
#: (or a stall) as far as that client can tell: see ``EtcdClient.last_silence``.
SILENCE_THRESHOLD = timedelta(seconds=2)
#: Pauses between rounds of attempts of one call over every member (jittered,
#: doubling up to the second).
RETRY_PAUSES = (timedelta(seconds=0.1), timedelta(seconds=0.5))
#: A call waiting or failing this long makes :meth:`EtcdClient.unreachable_for`
#: ask the members whether etcd has a quorum (:mod:`orchestrator.etcd.quorum`).
PROBE_AFTER = timedelta(seconds=0.5)


class EtcdClient:
    """A connected etcd client with fail-over.  Build it with :func:`connect`.

    ``raw`` is the members to talk to (:class:`~orchestrator.etcd.members.Members`),
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
        self._probe = QuorumProbe(self._members, self._in_trouble, self._quorum_seen)

    @property
    def _raw(self) -> Any:
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
        """
        trouble = self._trouble_since()
        if trouble is None:
            return 0.0
        now = time.monotonic()
        if now - trouble > PROBE_AFTER.total_seconds():
            self._probe.want()
        return max(now - max(trouble, self.last_success), 0.0)

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
        self._probe.close()
        self._members.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------

    def _call(
        self, fn: Callable[[Any], T], timeout: timedelta | None = None, *, quorum: bool = True
    ) -> T:
        """Run ``fn(raw_client)``; on connection errors fail over and retry until the deadline.

        ``quorum=False``: an answer does not show that etcd has a quorum (a watch
        is created, a status served, by a member alone).
        """
        started = time.monotonic()
        deadline = started + (timeout or self.options.op_timeout).total_seconds()
        call_id = next(self._ids)
        if timeout is None:  # long waits (watch-once) are not a sign of trouble
            self._waiting[call_id] = started
        try:
            return self._attempt(fn, deadline, started, timeout, quorum=quorum)
        finally:
            self._waiting.pop(call_id, None)

    def _attempt(
        self,
        fn: Callable[[Any], T],
        deadline: float,
        started: float,
        timeout: timedelta | None,
        *,
        quorum: bool = True,
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
                    self._authenticate(member)
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

    def _authenticate(self, member: Member) -> None:
        """Get ``member`` an auth token if it has none (user/password auth)."""
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

    # -- key/value ---------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        value, meta = self._call(lambda c: c.get(key))
        if meta is None:
            return None
        return key_value(key, value, meta)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """All keys under ``prefix``, sorted by key."""
        items = self._call(lambda c: list(c.get_prefix(prefix, sort_order="ascend")))
        return [key_value(meta.key.decode(), value, meta) for value, meta in items]

    def put(self, key: str, value: bytes | str, lease: Lease | None = None) -> int:
        """Write ``key``; returns the new revision."""
        data = value.encode() if isinstance(value, str) else value
        resp = self._call(lambda c: c.put(key, data, lease=lease.id if lease else None))
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        return bool(self._call(lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        resp = self._call(lambda c: c.delete_prefix(prefix))
        return int(resp.deleted)

    # -- transactions ------------------------------------------------------------------

    def compare_and_set(
        self,
        key: str,
        value: bytes | str,
        expected_mod_revision: int | None,
        lease: Lease | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Write ``key`` only if its ``mod_revision`` is still ``expected_mod_revision``.

        ``expected_mod_revision=None`` means: only if the key does not exist.

        Returns:
            ``(True, new KeyValue)`` on success, ``(False, current KeyValue or None)``
            when the revision moved (someone else wrote first).
        """
        data = value.encode() if isinstance(value, str) else value
        lease_id = lease.id if lease else None

        def txn(c: Any) -> Any:
            if expected_mod_revision is None:
                compare = [c.transactions.create(key) == 0]
            else:
                compare = [c.transactions.mod(key) == expected_mod_revision]
            return c.transaction(
                compare=compare,
                success=[c.transactions.put(key, data, lease=lease_id), c.transactions.get(key)],
                failure=[c.transactions.get(key)],
            )

        ok, responses = self._call(txn)
        got = responses[-1]
        current = key_value(key, got[0][0], got[0][1]) if got else None
        return bool(ok), current

    def create(self, key: str, value: bytes | str, lease: Lease | None = None) -> bool:
        """Write ``key`` only if absent; True when this call created it."""
        ok, _ = self.compare_and_set(key, value, None, lease)
        return ok

    def compare_value_and_set(
        self,
        key: str,
        expected_value: bytes,
        value: bytes | str,
        lease: Lease | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Write ``key`` only if it exists and holds exactly ``expected_value``.

        Returns:
            ``(True, new KeyValue)`` on success, ``(False, current KeyValue or None)``
            otherwise (a missing key never matches).
        """
        data = value.encode() if isinstance(value, str) else value
        lease_id = lease.id if lease else None

        def txn(c: Any) -> Any:
            return c.transaction(
                compare=[c.transactions.value(key) == expected_value],
                success=[c.transactions.put(key, data, lease=lease_id), c.transactions.get(key)],
                failure=[c.transactions.get(key)],
            )

        ok, responses = self._call(txn)
        got = responses[-1]
        current = key_value(key, got[0][0], got[0][1]) if got else None
        return bool(ok), current

    def put_guarded(
        self,
        key: str,
        value: bytes | str,
        guard_key: str,
        guard_mod_revision: int,
        lease: Lease | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Write ``key`` only while ``guard_key`` is still at ``guard_mod_revision``.

        The fencing primitive: a write made on behalf of one membership
        generation succeeds only if the generation key has not moved since.

        Returns:
            ``(True, None)`` when written, ``(False, current guard KeyValue or None)``
            when the guard moved.
        """
        data = value.encode() if isinstance(value, str) else value
        lease_id = lease.id if lease else None

        def txn(c: Any) -> Any:
            return c.transaction(
                compare=[c.transactions.mod(guard_key) == guard_mod_revision],
                success=[c.transactions.put(key, data, lease=lease_id)],
                failure=[c.transactions.get(guard_key)],
            )

        ok, responses = self._call(txn)
        if ok:
            return True, None
        got = responses[-1]
        return False, (key_value(guard_key, got[0][0], got[0][1]) if got else None)

    def get_many(self, keys: list[str]) -> dict[str, KeyValue]:
        """Read several keys in one transaction; the result holds those that exist.

        Batches of :data:`MAX_TXN_OPS` keys are read atomically each.
        """
        found: dict[str, KeyValue] = {}
        for start in range(0, len(keys), MAX_TXN_OPS):
            batch = keys[start : start + MAX_TXN_OPS]

            def txn(c: Any, batch: list[str] = batch) -> Any:
                return c.transaction(
                    compare=[], success=[c.transactions.get(k) for k in batch], failure=[]
                )

            _, responses = self._call(txn)
            for key, got in zip(batch, responses, strict=True):
                if got:
                    found[key] = key_value(key, got[0][0], got[0][1])
        return found

    def put_many(self, items: list[tuple[str, bytes]], lease: Lease | None = None) -> None:
        """Write several keys, atomically per batch of :data:`MAX_TXN_OPS`."""
        lease_id = lease.id if lease else None
        for start in range(0, len(items), MAX_TXN_OPS):
            batch = items[start : start + MAX_TXN_OPS]

            def txn(c: Any, batch: list[tuple[str, bytes]] = batch) -> Any:
                ops = [c.transactions.put(k, v, lease=lease_id) for k, v in batch]
                return c.transaction(compare=[], success=ops, failure=[])

            self._call(txn)

    def get_with_revision(self, key: str) -> tuple[KeyValue | None, int]:
        """Read ``key`` and the store revision the read saw (to watch from without gaps)."""
        resp = self._call(lambda c: c.get_response(key))
        revision = int(resp.header.revision)
        if not resp.kvs:
            return None, revision
        kv = resp.kvs[0]
        value = KeyValue(
            key=key,
            value=bytes(kv.value),
            mod_revision=int(kv.mod_revision),
            create_revision=int(kv.create_revision),
            version=int(kv.version),
            lease_id=int(kv.lease),
        )
        return value, revision

    def count_prefix(self, prefix: str) -> int:
        """How many keys live under ``prefix`` (counted by etcd, values not sent)."""
        resp = self._call(lambda c: c.get_prefix_response(prefix, count_only=True))
        return int(resp.count)

    def wait_for_change(self, key: str, after_revision: int, timeout: timedelta) -> bool:
        """Block until ``key`` changes after ``after_revision``, or ``timeout`` passes.

        Returns:
            True when a change (or a watch error worth re-reading for) arrived,
            False on timeout.
        """
        seconds = max(timeout.total_seconds(), 0.0)

        def watch(c: Any) -> Any:
            try:
                return c.watch_once_response(
                    key, timeout=seconds, start_revision=after_revision + 1
                )
            except etcd_exc.WatchTimedOut:
                return None

        return (
            self._call(watch, timeout=timeout + self.options.op_timeout, quorum=False) is not None
        )

    # -- leases ------------------------------------------------------------------------

    def lease(self, ttl: int) -> Lease:
        """Grant a lease of ``ttl`` seconds (etcd's minimum effective TTL is a few seconds)."""
        raw = self._call(lambda c: c.lease(int(ttl)))
        return Lease(self, raw, int(ttl))

    # -- watches -----------------------------------------------------------------------

    def watch(self, key: str, *, prefix: bool = False, start_revision: int | None = None) -> Watch:
        """Watch a key (or every key under a prefix) from ``start_revision`` on."""
        kwargs: dict[str, Any] = {}
        if start_revision is not None:
            kwargs["start_revision"] = start_revision
        if prefix:
            events, cancel = self._call(lambda c: c.watch_prefix(key, **kwargs), quorum=False)
        else:
            events, cancel = self._call(lambda c: c.watch(key, **kwargs), quorum=False)
        return Watch(events, cancel)

    # -- cluster -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        st = self._call(lambda c: c.status(), quorum=False)
        return {"version": st.version, "db_size": st.db_size, "raft_index": st.raft_index}


def connect(options: EtcdOptions) -> EtcdClient:
    """Connect to the first etcd endpoint that answers within ``connect_timeout``.

    Raises:
        EtcdUnavailableError: no endpoint answered; names every endpoint and its error.
        EtcdAuthError: an endpoint answered but refused the credentials, or TLS
            between the options and every endpoint that answered cannot work.
        EtcdError: an endpoint is malformed or a TLS file cannot be read.
    """
    return EtcdClient(options, channel.open_client(options))
