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
* Every read of a range is paged (:meth:`EtcdClient.get_prefix`,
  :meth:`EtcdClient.get_keys`, :meth:`EtcdClient.child_names`,
  :meth:`EtcdClient.get_many`): pages of about :data:`PAGE_BYTES`, all read at
  the revision of the first, so the result is one consistent snapshot however
  large it is and no answer nears the gRPC message limits
  (:mod:`orchestrator.etcd.members`).  A write over etcd's request limit is
  refused before it is sent, naming the key
  (:class:`~orchestrator.etcd.diagnosis.EtcdRequestTooLargeError`).
* A write etcd refuses for want of space (its NOSPACE alarm) raises
  :class:`~orchestrator.etcd.diagnosis.EtcdNoSpaceError`, an
  :class:`~orchestrator.api.EtcdUnavailableError`, and counts in
  :meth:`EtcdClient.unreachable_for` until a write goes through again: the job
  pauses as for a lost quorum instead of failing.
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
import etcd3.utils as etcd_utils
import grpc
from etcd3 import etcdrpc

from orchestrator.api import EtcdAuthError, EtcdError, EtcdUnavailableError
from orchestrator.etcd import channel, diagnosis
from orchestrator.etcd import quorum as quorum_mod
from orchestrator.etcd.diagnosis import (
    EtcdCompactedError,
    EtcdNoSpaceError,
    EtcdRequestTooLargeError,
    EtcdResponseTooLargeError,
)
from orchestrator.etcd.kv import KeyValue, Lease, Watch, from_proto, key_value
from orchestrator.etcd.members import MAX_REQUEST_BYTES, Member, Members, attempt_timeout
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.quorum import QuorumProbe
from orchestrator.etcd.retry import Backoff

T = TypeVar("T")

#: Operations per transaction (etcd's default ``--max-txn-ops``).
MAX_TXN_OPS = 128
#: What one page of a range read, or one batch of writes, aims to stay under.
PAGE_BYTES = 1024 * 1024
#: Keys asked for in the first page of a range read; later pages are sized from
#: the bytes per key seen so far, to about :data:`PAGE_BYTES`.
FIRST_PAGE_KEYS = 64
#: The most keys asked for in one page.
MAX_PAGE_KEYS = 4096
#: Keys per page when only keys are read (an answer of keys is small).
KEYS_PAGE = 1024
#: Bytes a key-value costs in an answer beyond its key and value (revisions, lease).
KV_OVERHEAD_BYTES = 32
#: Room left in a write for what etcd adds around the key and value: a put of
#: key and value larger than ``MAX_REQUEST_BYTES`` minus this is refused here.
REQUEST_OVERHEAD_BYTES = 1024
#: How often a paged read starts again when the revision it reads at was
#: compacted away between two pages.
COMPACTED_RESTARTS = 3
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
        #: ``time.monotonic()`` of the first write etcd refused for want of space
        #: (NOSPACE) since the last write it took; None when writes go through.
        self._no_space_since: float | None = None
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

        etcd refusing writes for want of space (its NOSPACE alarm) is etcd
        being away too, from the first write it refused until one goes through
        again (or :meth:`no_space` finds the alarm gone): reads still work, but
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
        self._probe.close()
        self._members.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------

    def _call(
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
            self._end_no_space()
        return result

    def _end_no_space(self) -> None:
        """etcd takes writes again: a NOSPACE alarm that lasted is a silence
        (:attr:`last_silence`), as an outage is (the controller pauses the job for it)."""
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
        """All keys under ``prefix`` with their values, sorted by key.

        Read in pages of about :data:`PAGE_BYTES`, every page at the revision of
        the first: one consistent snapshot, however many keys and bytes.
        """
        end = etcd_utils.prefix_range_end(prefix.encode())
        return self._read_range(prefix.encode(), end, keys_only=False, what=f" reading {prefix}*")

    def get_keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, sorted, without their values (paged, one snapshot)."""
        end = etcd_utils.prefix_range_end(prefix.encode())
        found = self._read_range(prefix.encode(), end, keys_only=True, what=f" listing {prefix}*")
        return [kv.key for kv in found]

    def child_names(self, prefix: str) -> list[str]:
        """The distinct first segments of the keys under ``prefix``, sorted.

        ``child_names("/ringmaster/jobs/")`` is the job names.  Neither values
        nor every key are read: once a page names a child, the next page starts
        after every key of that child (``<prefix><name>/`` ... ``<prefix><name>0``),
        so it costs a request per child with many keys, not a read of them all.
        Every page is read at the revision of the first.
        """
        encoded = prefix.encode()
        end = etcd_utils.prefix_range_end(encoded)
        names: list[str] = []
        start = encoded
        revision: int | None = None
        while True:
            resp = self._range_page(start, end, KEYS_PAGE, revision, True, f" listing {prefix}*")
            if revision is None:
                revision = int(resp.header.revision)
            for kv in resp.kvs:
                name = bytes(kv.key)[len(encoded) :].split(b"/", 1)[0].decode()
                if not names or names[-1] != name:
                    names.append(name)
            if not resp.more or not resp.kvs:
                return sorted(set(names))
            # Past the last child seen: its keys all lie below "<prefix><name>0"
            # ("0" sorts right after "/").  A child whose page was cut short is
            # the last one, so no child is skipped.
            last = bytes(resp.kvs[-1].key)[len(encoded) :]
            child, slash, _ = last.partition(b"/")
            start = encoded + child + (b"0" if slash else b"\x00")

    def _read_range(
        self, start: bytes, end: bytes, *, keys_only: bool, what: str
    ) -> list[KeyValue]:
        """Every key in ``[start, end)``, paged at one revision (see :meth:`get_prefix`).

        A page whose answer was over the gRPC receive limit is asked for again
        in halves; a revision compacted away between two pages starts the read
        again (up to :data:`COMPACTED_RESTARTS` times).

        Raises:
            EtcdError: as for any call; ``EtcdResponseTooLargeError`` only when a
                single key-value is over the receive limit.
        """
        for attempt in range(COMPACTED_RESTARTS + 1):
            try:
                return self._read_pages(start, end, keys_only, what)
            except EtcdCompactedError:
                if attempt == COMPACTED_RESTARTS:
                    raise
        raise AssertionError("unreachable")

    def _read_pages(self, start: bytes, end: bytes, keys_only: bool, what: str) -> list[KeyValue]:
        out: list[KeyValue] = []
        revision: int | None = None
        limit = KEYS_PAGE if keys_only else FIRST_PAGE_KEYS
        key = start
        while True:
            try:
                resp = self._range_page(key, end, limit, revision, keys_only, what)
            except EtcdResponseTooLargeError:
                if limit == 1:
                    raise
                limit = max(limit // 2, 1)
                continue
            if revision is None:
                revision = int(resp.header.revision)
            out.extend(from_proto(kv) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return out
            key = bytes(resp.kvs[-1].key) + b"\x00"
            if not keys_only:
                size = sum(len(kv.key) + len(kv.value) + KV_OVERHEAD_BYTES for kv in resp.kvs)
                per_key = max(size / len(resp.kvs), 1.0)
                limit = max(1, min(int(PAGE_BYTES / per_key), MAX_PAGE_KEYS))

    def _range_page(
        self,
        start: bytes,
        end: bytes,
        limit: int,
        revision: int | None,
        keys_only: bool,
        what: str,
    ) -> Any:
        """One page: at most ``limit`` keys of ``[start, end)`` at ``revision`` (None: now)."""

        def page(c: Any) -> Any:
            return c.get_range_response(
                start,
                end,
                sort_order="ascend",
                limit=limit,
                revision=revision,
                keys_only=keys_only,
            )

        return self._call(page, what=what)

    def put(self, key: str, value: bytes | str, lease: Lease | None = None) -> int:
        """Write ``key``; returns the new revision.

        Raises:
            EtcdRequestTooLargeError: key and value are over etcd's request limit
                (checked here: nothing is sent).
            EtcdNoSpaceError: etcd's database is full (NOSPACE alarm).
        """
        data = value.encode() if isinstance(value, str) else value
        check_request_size(key, data)
        resp = self._call(
            lambda c: c.put(key, data, lease=lease.id if lease else None),
            write=True,
            what=f" writing {key}",
        )
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        return bool(self._call(lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        resp = self._call(lambda c: c.delete_prefix(prefix))
        return int(resp.deleted)

    def keep_newest(self, prefix: str, keep: int, slack: int = 0) -> int:
        """Delete the first keys under ``prefix`` (in key order) so that ``keep`` remain.

        For logs whose keys sort by time (events, recoveries): the oldest go.
        Cheap enough for every append: etcd counts the keys (nothing is sent
        back), and only once there are more than ``keep + slack`` are the
        surplus keys listed (keys only, in pages) and deleted, a range per page.
        A ``slack`` lets deletions come in batches rather than one per append.

        Returns:
            How many keys were deleted.
        """
        surplus = self.count_prefix(prefix) - keep
        if surplus <= slack:
            return 0
        encoded = prefix.encode()
        deleted = 0
        while surplus > 0:
            resp = self._range_page(
                encoded,
                etcd_utils.prefix_range_end(encoded),
                min(surplus, KEYS_PAGE),
                None,
                True,
                f" listing {prefix}*",
            )
            if not resp.kvs:
                break
            last = bytes(resp.kvs[-1].key) + b"\x00"
            request = etcdrpc.DeleteRangeRequest(key=encoded, range_end=last)
            done = self._call(_stub_call("DeleteRange", request), what=f" trimming {prefix}*")
            deleted += int(done.deleted)
            surplus -= len(resp.kvs)
        return deleted

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
        check_request_size(key, data)
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

        ok, responses = self._call(txn, write=True, what=f" writing {key}")
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
        check_request_size(key, data, len(expected_value))
        lease_id = lease.id if lease else None

        def txn(c: Any) -> Any:
            return c.transaction(
                compare=[c.transactions.value(key) == expected_value],
                success=[c.transactions.put(key, data, lease=lease_id), c.transactions.get(key)],
                failure=[c.transactions.get(key)],
            )

        ok, responses = self._call(txn, write=True, what=f" writing {key}")
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
        check_request_size(key, data, len(guard_key))
        lease_id = lease.id if lease else None

        def txn(c: Any) -> Any:
            return c.transaction(
                compare=[c.transactions.mod(guard_key) == guard_mod_revision],
                success=[c.transactions.put(key, data, lease=lease_id)],
                failure=[c.transactions.get(guard_key)],
            )

        ok, responses = self._call(txn, write=True, what=f" writing {key}")
        if ok:
            return True, None
        got = responses[-1]
        return False, (key_value(guard_key, got[0][0], got[0][1]) if got else None)

    def get_many(self, keys: list[str]) -> dict[str, KeyValue]:
        """Read several keys; the result holds those that exist.

        Read in transactions of up to :data:`MAX_TXN_OPS` keys, all at the
        revision of the first: one consistent snapshot.  A batch whose answer
        is over the gRPC receive limit is read again in halves.
        """
        for attempt in range(COMPACTED_RESTARTS + 1):
            try:
                return self._get_many_at_one_revision(keys)
            except EtcdCompactedError:
                if attempt == COMPACTED_RESTARTS:
                    raise
        raise AssertionError("unreachable")

    def _get_many_at_one_revision(self, keys: list[str]) -> dict[str, KeyValue]:
        found: dict[str, KeyValue] = {}
        revision: int | None = None
        pending = [keys[i : i + MAX_TXN_OPS] for i in range(0, len(keys), MAX_TXN_OPS)]
        while pending:
            batch = pending.pop(0)
            ops = [
                etcdrpc.RequestOp(
                    request_range=etcdrpc.RangeRequest(key=k.encode(), revision=revision or 0)
                )
                for k in batch
            ]
            request = etcdrpc.TxnRequest(compare=[], success=ops, failure=[])
            try:
                resp = self._call(
                    _stub_call("Txn", request), what=f" reading {len(batch)} keys from {batch[0]}"
                )
            except EtcdNoSpaceError:
                # Over its quota etcd refuses every transaction, reads too (plain
                # reads it serves): read the keys one by one instead.
                revision = self._get_each(batch, revision, found)
                continue
            except EtcdResponseTooLargeError:
                if len(batch) == 1:
                    raise
                half = len(batch) // 2
                pending[:0] = [batch[:half], batch[half:]]
                continue
            if revision is None:
                revision = int(resp.header.revision)
            for key, answer in zip(batch, resp.responses, strict=True):
                for kv in answer.response_range.kvs:
                    found[key] = from_proto(kv, key)
        return found

    def _get_each(
        self, batch: list[str], revision: int | None, found: dict[str, KeyValue]
    ) -> int | None:
        """Read ``batch`` a key at a time at ``revision`` into ``found``; returns the revision."""
        for key in batch:

            def one(c: Any, key: str = key, at: int | None = revision) -> Any:
                return c.get_response(key, revision=at)

            resp = self._call(one, what=f" reading {key}")
            if revision is None:
                revision = int(resp.header.revision)
            for kv in resp.kvs:
                found[key] = from_proto(kv, key)
        return revision

    def put_many(self, items: list[tuple[str, bytes]], lease: Lease | None = None) -> None:
        """Write several keys, atomically per batch.

        A batch holds up to :data:`MAX_TXN_OPS` keys and about :data:`PAGE_BYTES`
        (a key-value larger than that is a batch of its own).

        Raises:
            EtcdRequestTooLargeError: one key-value is over etcd's request limit
                (checked before anything is written).
        """
        lease_id = lease.id if lease else None
        for key, value in items:
            check_request_size(key, value)
        for batch in _batches(items):

            def txn(c: Any, batch: list[tuple[str, bytes]] = batch) -> Any:
                ops = [c.transactions.put(k, v, lease=lease_id) for k, v in batch]
                return c.transaction(compare=[], success=ops, failure=[])

            self._call(txn, write=True, what=f" writing {len(batch)} keys from {batch[0][0]}")

    def get_with_revision(self, key: str) -> tuple[KeyValue | None, int]:
        """Read ``key`` and the store revision the read saw (to watch from without gaps)."""
        resp = self._call(lambda c: c.get_response(key))
        revision = int(resp.header.revision)
        if not resp.kvs:
            return None, revision
        return from_proto(resp.kvs[0], key), revision

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
        raw = self._call(lambda c: c.lease(int(ttl)), write=True, what=" granting a lease")
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

    def db_sizes(self, timeout: timedelta = quorum_mod.PROBE_TIMEOUT) -> dict[str, int]:
        """Each member's database size in bytes (asked at once; members that did not
        answer within ``timeout`` are left out)."""
        statuses = quorum_mod.poll_status(self._members, timeout)
        return {m.endpoint: int(st.dbSize) for m, st in statuses.items() if st is not None}

    def alarms(self) -> list[tuple[int, str]]:
        """The alarms raised in the cluster: ``(member id, kind)``, kind ``NOSPACE`` or
        ``CORRUPT``.  A NOSPACE alarm found gone ends the outage it started
        (:meth:`unreachable_for`)."""
        raw = self._call(lambda c: list(c.list_alarms()), quorum=False)
        found = [(int(a.member_id), alarm_name(int(a.alarm_type))) for a in raw]
        if not any(kind == "NOSPACE" for _, kind in found):
            self._end_no_space()
        return found

    def no_space(self) -> bool:
        """etcd refuses writes for want of space: a NOSPACE alarm is raised."""
        return any(kind == "NOSPACE" for _, kind in self.alarms())

    def check_writable(self) -> None:
        """Raise while etcd refuses writes for want of space (for waits that must last
        as long as the NOSPACE alarm, as ``retry_unavailable(client.check_writable)``).

        Raises:
            EtcdNoSpaceError: a NOSPACE alarm is raised.
        """
        if self.no_space():
            raise EtcdNoSpaceError(list(self.endpoints), "NOSPACE alarm raised")

    def current_revision(self) -> int:
        """etcd's current revision (that of its newest write)."""
        return int(self._call(lambda c: c.get_response("/")).header.revision)

    def compact(self, revision: int | None = None) -> int:
        """Compact etcd's history up to ``revision`` (default: the current one); returns it.

        Old versions of keys become free space in the database (reused by
        later writes; :meth:`defragment` gives it back to the file system).
        """
        at = self.current_revision() if revision is None else int(revision)
        self._call(lambda c: c.compact(at, physical=True))
        return at

    def defragment(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Defragment every member's database, one after another.

        A member serves nothing while it defragments; doing one at a time keeps
        a quorum of a cluster answering.
        """
        for member in self._members.members:
            try:
                with attempt_timeout(timeout.total_seconds()):
                    self._authenticate(member)
                    member.raw.defragment()
            except Exception as e:
                raise EtcdError(
                    f"defragmenting etcd at {member.endpoint} failed: {diagnosis.reason(e)}"
                ) from e

    def disarm_no_space(self) -> int:
        """Disarm every NOSPACE alarm (after space was freed); returns how many."""
        raised = [member for member, kind in self.alarms() if kind == "NOSPACE"]
        for member_id in raised:

            def disarm(c: Any, member_id: int = member_id) -> Any:
                return c.disarm_alarm(member_id=member_id)

            self._call(disarm, quorum=False)
        self._end_no_space()
        return len(raised)


def alarm_name(kind: int) -> str:
    """``NOSPACE``, ``CORRUPT``... for an etcd alarm type (the library knows only NOSPACE)."""
    try:
        return str(etcdrpc.AlarmType.Name(kind))
    except ValueError:
        return {2: "CORRUPT"}.get(kind, f"ALARM{kind}")


def check_request_size(key: str, value: bytes, extra: int = 0) -> None:
    """Refuse, before sending it, a write that etcd would refuse as too large.

    Args:
        key / value: what is written.
        extra: other bytes the request carries (a compared value, a guard key).

    Raises:
        EtcdRequestTooLargeError: naming the key, its size and the limit.
    """
    size = len(key.encode()) + len(value) + extra
    if size + REQUEST_OVERHEAD_BYTES > MAX_REQUEST_BYTES:
        raise EtcdRequestTooLargeError(
            f"refusing to write {key}: {size} bytes is over etcd's request limit "
            f"({MAX_REQUEST_BYTES} bytes, --max-request-bytes, less "
            f"{REQUEST_OVERHEAD_BYTES} for the request around it); store less under one key"
        )


def _batches(items: list[tuple[str, bytes]]) -> list[list[tuple[str, bytes]]]:
    """``items`` in batches of at most :data:`MAX_TXN_OPS` and about :data:`PAGE_BYTES`."""
    out: list[list[tuple[str, bytes]]] = []
    batch: list[tuple[str, bytes]] = []
    size = 0
    for key, value in items:
        cost = len(key) + len(value) + KV_OVERHEAD_BYTES
        if batch and (len(batch) == MAX_TXN_OPS or size + cost > PAGE_BYTES):
            out.append(batch)
            batch, size = [], 0
        batch.append((key, value))
        size += cost
    if batch:
        out.append(batch)
    return out


def _stub_call(method: str, request: Any) -> Callable[[Any], Any]:
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


def connect(options: EtcdOptions) -> EtcdClient:
    """Connect to the first etcd endpoint that answers within ``connect_timeout``.

    Raises:
        EtcdUnavailableError: no endpoint answered; names every endpoint and its error.
        EtcdAuthError: an endpoint answered but refused the credentials, or TLS
            between the options and every endpoint that answered cannot work.
        EtcdError: an endpoint is malformed or a TLS file cannot be read.
    """
    return EtcdClient(options, channel.open_client(options))
