"""All etcd access goes through this module.

It wraps the ``etcd3`` v3-API client (installed from the ``cslab-etcd3``
distribution) with what the rest of ringmaster needs and nothing else:

* :func:`connect` tries every endpoint within a connect timeout and fails with
  an :class:`~orchestrator.api.EtcdUnavailableError` naming each endpoint tried
  and why; TLS (CA, client cert/key) and user/password are options.
* Calls fail over between endpoints and are retried for up to the operation
  timeout when an endpoint is unreachable, so a single member going down is
  invisible to callers.
* Values are ``bytes`` in, ``bytes`` out; JSON helpers sit on top.
* Compare-and-set on ``mod_revision`` (the primitive rendezvous, leader
  election and fencing are built from), leases, prefix watches.
* For the c10d store: compare-and-set on a value, multi-key reads and writes
  in one transaction, and waits that watch a key from the revision a read saw.
* A TLS mismatch (wrong CA, a client certificate the server refuses, plain
  text against a TLS server or the reverse) fails at once with an
  :class:`~orchestrator.api.EtcdAuthError` that names the endpoint and the
  option to check, instead of waiting out the connect timeout.
* With user/password, the auth token is sent as call metadata, so it works on
  plain-text channels too (gRPC refuses call credentials there), and a token
  the server no longer knows (another member, expiry) is renewed once.
  Passwords never appear in messages, logs or ``repr``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

# gRPC's C core logs every failed TLS handshake at INFO on stderr unless told
# otherwise; the error raised here says what went wrong in one line instead.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# Every process ringmaster starts is fork+exec (workers, agents, etcd).  gRPC's
# fork handlers are for fork *without* exec; around a fork+exec they race with
# gRPC's own threads and, under load, abort processes ("Bad file descriptor" in
# the epoll poller, abseil mutex checks).  Off, as gRPC advises for fork+exec.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import etcd3
import etcd3.exceptions as etcd_exc
import grpc
from etcd3 import etcdrpc

from orchestrator.api import EtcdAuthError, EtcdError, EtcdUnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long :func:`connect` waits for some endpoint to answer.
DEFAULT_CONNECT_TIMEOUT = timedelta(
    seconds=float(os.environ.get("RINGMASTER_ETCD_CONNECT_TIMEOUT", "5"))
)
#: Per-operation deadline, including fail-over retries across endpoints.
DEFAULT_OP_TIMEOUT = timedelta(seconds=float(os.environ.get("RINGMASTER_ETCD_OP_TIMEOUT", "10")))
#: How long a failed endpoint is avoided before it is tried again.
ENDPOINT_RETRY_AFTER = timedelta(seconds=1)
#: Operations per transaction (etcd's default ``--max-txn-ops``).
MAX_TXN_OPS = 128

#: A gap this long between two answered calls of a busy client is an etcd outage
#: (or a stall) as far as that client can tell: see ``EtcdClient.last_silence``.
SILENCE_THRESHOLD = timedelta(seconds=2)
#: Longest pause between two attempts of :func:`retry_unavailable`.
MAX_BACKOFF = timedelta(seconds=2)

_RETRYABLE = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
)

# What etcd answers while it has no leader (quorum lost, election running): the
# request reached a member but could not be committed.  Worth retrying.
_NO_QUORUM_DETAILS = (
    "context deadline exceeded",
    "request timed out",
    "no leader",
    "leader changed",
    "raft proposal dropped",
    "too many requests",
)


def _transient(e: grpc.RpcError) -> bool:
    code = e.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return True
    details = (e.details() or "").lower()
    return any(d in details for d in _NO_QUORUM_DETAILS)


def _describe(endpoint: str, e: Exception | None) -> str:
    """Why ``endpoint`` did not serve a call that failed with ``e``, for people."""
    what = type(e).__name__ if e is not None else "no answer"
    if isinstance(e, grpc.RpcError):
        what = f"{e.code().name}: {e.details() or ''}"
    try:
        host, port = _host_port(endpoint)
        with socket.create_connection((host, port), timeout=0.3):
            pass
    except OSError as err:
        return f"down or unreachable: {err.strerror or type(err).__name__}"
    except EtcdError:
        return what
    return f"accepts connections but did not answer ({what}): cluster without quorum?"


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd.

    Attributes:
        endpoints: ``host:port`` or ``http(s)://host:port`` client endpoints.
        ca_cert / cert / key: TLS files; ``ca_cert`` alone means server-auth TLS.
        user / password: etcd RBAC credentials (the password is never logged).
        connect_timeout: how long :func:`connect` waits for some endpoint.
        op_timeout: deadline of each call, fail-over retries included.
    """

    endpoints: tuple[str, ...]
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT
    op_timeout: timedelta = DEFAULT_OP_TIMEOUT

    @property
    def secure(self) -> bool:
        return bool(self.ca_cert) or any(e.startswith("https://") for e in self.endpoints)


def parse_endpoints(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"a:1,b:2"`` or a list → a tuple of endpoints, whitespace trimmed, empties dropped."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(s.strip() for s in items if s.strip())


def _host_port(endpoint: str) -> tuple[str, int]:
    rest = endpoint.split("://", 1)[1] if "://" in endpoint else endpoint
    rest = rest.rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise EtcdError(f"etcd endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class KeyValue:
    """A key with its value and revisions."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease_id: int


@dataclass(frozen=True)
class WatchEvent:
    """A put (``value`` set) or delete (``value`` is None) seen by a watch."""

    key: str
    value: bytes | None
    mod_revision: int

    @property
    def deleted(self) -> bool:
        return self.value is None


class Lease:
    """An etcd lease; keys put with it vanish when it expires or is revoked."""

    def __init__(self, client: EtcdClient, raw: Any, ttl: int) -> None:
        self._client = client
        self._raw = raw
        self.ttl = ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def id(self) -> int:
        return int(self._raw.id)

    def refresh(self) -> int:
        """Refresh once; returns the TTL granted, ``<= 0`` when the lease is gone."""
        responses = self._client._call(lambda c: list(c.refresh_lease(self.id)))
        return int(responses[-1].TTL) if responses else -1

    def revoke(self) -> None:
        self.stop_keepalive()
        try:
            self._client._call(lambda c: c.revoke_lease(self.id))
        except EtcdError as e:  # the lease expires on its own anyway
            log.debug("revoking lease %x failed: %s", self.id, e)

    def remaining(self) -> int:
        """Seconds left, or -1 when the lease is gone."""
        info = self._client._call(lambda c: c.get_lease_info(self.id))
        return int(info.TTL)

    def keep_alive(
        self, interval: float | None = None, on_lost: Callable[[Lease], None] | None = None
    ) -> None:
        """Refresh in a daemon thread every ``interval`` s (default ttl/3) until stopped.

        Failed refreshes (etcd unreachable, no quorum) are retried: etcd extends
        every lease by its TTL when a new raft leader is elected, so a lease
        usually outlives an outage.  When etcd answers that the lease is gone,
        ``on_lost(lease)`` is called once and the thread ends.
        """
        if self._thread is not None:
            return
        every = interval if interval is not None else max(self.ttl / 3.0, 0.2)
        self._stop.clear()

        def loop() -> None:
            failing = False
            while not self._stop.wait(every):
                try:
                    ttl = self.refresh()
                except EtcdError as e:
                    if not failing:
                        log.warning("lease %x keep-alive failing (retrying): %s", self.id, e)
                    failing = True
                    continue
                if failing and ttl > 0:
                    log.warning("lease %x kept alive again", self.id)
                failing = False
                if ttl <= 0:
                    log.warning("lease %x expired", self.id)
                    if on_lost is not None:
                        on_lost(self)
                    return

        self._thread = threading.Thread(target=loop, name=f"lease-{self.id:x}", daemon=True)
        self._thread.start()

    def stop_keepalive(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None


class Watch:
    """A running watch; iterate it for events, ``cancel()`` to stop."""

    def __init__(self, events: Iterator[Any], cancel: Callable[[], None]) -> None:
        self._events = events
        self._cancel = cancel

    def __iter__(self) -> Iterator[WatchEvent]:
        for ev in self._events:
            value = None if isinstance(ev, etcd3.events.DeleteEvent) else bytes(ev.value)
            yield WatchEvent(ev.key.decode(), value, int(ev.mod_revision))

    def cancel(self) -> None:
        self._cancel()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class EtcdClient:
    """A connected etcd client with fail-over.  Build it with :func:`connect`."""

    def __init__(self, options: EtcdOptions, raw: Any) -> None:
        self.options = options
        self._raw = raw
        self._auth_lock = threading.Lock()
        #: ``time.monotonic()`` of the last call etcd answered (the cluster had quorum).
        self.last_success = time.monotonic()
        #: ``(monotonic end, seconds)`` of the last time etcd kept this client's
        #: calls waiting or failing for longer than :data:`SILENCE_THRESHOLD`: an
        #: outage or a stall of etcd, during which leases may have expired for
        #: reasons of etcd's own.
        self.last_silence: tuple[float, float] | None = None
        self._waiting: dict[int, float] = {}  # call id -> start, ordinary calls in flight
        self._ids = itertools.count()
        self._failing_since: float | None = None

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

    def unreachable_for(self) -> float:
        """How long etcd has kept a call of this client waiting or failing (0: all is well).

        Counts ordinary calls still in flight and calls that failed since the last
        answer, so an idle client is not "unreachable".
        """
        now = time.monotonic()
        oldest = min(self._waiting.values(), default=now)
        failing = self._failing_since
        if failing is not None:
            oldest = min(oldest, failing)
        return now - oldest

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.options.endpoints

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------

    def _call(self, fn: Callable[[Any], T], timeout: timedelta | None = None) -> T:
        """Run ``fn(raw_client)``; on connection errors fail over and retry until the deadline."""
        started = time.monotonic()
        deadline = started + (timeout or self.options.op_timeout).total_seconds()
        call_id = next(self._ids)
        if timeout is None:  # long waits (watch-once) are not a sign of trouble
            self._waiting[call_id] = started
        try:
            return self._attempt(fn, deadline, started, timeout)
        finally:
            self._waiting.pop(call_id, None)

    def _attempt(
        self, fn: Callable[[Any], T], deadline: float, started: float, timeout: timedelta | None
    ) -> T:
        last: Exception | None = None
        renewed = False
        while True:
            try:
                result = fn(self._raw)
                now = time.monotonic()
                # Silence is etcd keeping calls waiting or failing, not a gap between
                # calls: a process that was idle or starved of CPU saw no outage.
                # (A call with its own timeout is a long wait by design: only its
                # failures count.)
                since = started if timeout is None else now
                if self._failing_since is not None:
                    since = min(since, self._failing_since)
                waited = now - since
                if waited > SILENCE_THRESHOLD.total_seconds():
                    self._record_silence(now, waited)
                self.last_success = now
                self._failing_since = None
                return result
            except _RETRYABLE as e:
                last = e
            except grpc.RpcError as e:
                if _token_rejected(e) and self.options.user and not renewed:
                    renewed = True
                    self._renew_token()
                    continue
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    who = f"user {self.options.user!r}" if self.options.user else "no user"
                    raise EtcdAuthError(
                        f"etcd at {', '.join(self.endpoints)} refused the request ({who}): "
                        f"{e.details()}; check --etcd-user / RINGMASTER_ETCD_USER and the "
                        "user's role (it needs read-write on the /ringmaster/ prefix)"
                    ) from e
                if "user name is empty" in (e.details() or ""):
                    raise EtcdAuthError(
                        f"etcd at {', '.join(self.endpoints)} requires authentication: pass "
                        "--etcd-user and --etcd-password (or RINGMASTER_ETCD_USER / "
                        "RINGMASTER_ETCD_PASSWORD)"
                    ) from e
                if not _transient(e):
                    raise EtcdError(f"etcd error {e.code().name}: {e.details()}") from e
                last = e
            if self._failing_since is None:
                self._failing_since = started
            if time.monotonic() >= deadline:
                reasons = {ep: _describe(ep, last) for ep in self.endpoints}
                raise EtcdUnavailableError(
                    list(self.endpoints),
                    timeout or self.options.op_timeout,
                    reasons,
                ) from last
            time.sleep(0.1)

    def _renew_token(self) -> None:
        """Authenticate again (the member answering did not know the token)."""
        with self._auth_lock:
            try:
                _authenticate(self._raw, self.options)
            except grpc.RpcError as e:
                raise EtcdAuthError(
                    f"etcd at {', '.join(self.endpoints)} refused user "
                    f"{self.options.user!r}: {e.details()}; check --etcd-user and "
                    "--etcd-password / RINGMASTER_ETCD_PASSWORD"
                ) from e

    # -- key/value ---------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        value, meta = self._call(lambda c: c.get(key))
        if meta is None:
            return None
        return _kv(key, value, meta)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """All keys under ``prefix``, sorted by key."""
        items = self._call(lambda c: list(c.get_prefix(prefix, sort_order="ascend")))
        return [_kv(meta.key.decode(), value, meta) for value, meta in items]

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

    def put_json(self, key: str, obj: Any, lease: Lease | None = None) -> int:
        return self.put(key, json.dumps(obj, sort_keys=True), lease)

    def get_json(self, key: str) -> Any | None:
        kv = self.get(key)
        return None if kv is None else json.loads(kv.value)

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
        current = _kv(key, got[0][0], got[0][1]) if got else None
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
        current = _kv(key, got[0][0], got[0][1]) if got else None
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
        return False, (_kv(guard_key, got[0][0], got[0][1]) if got else None)

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
                    found[key] = _kv(key, got[0][0], got[0][1])
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

        return self._call(watch, timeout=timeout + self.options.op_timeout) is not None

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
            events, cancel = self._call(lambda c: c.watch_prefix(key, **kwargs))
        else:
            events, cancel = self._call(lambda c: c.watch(key, **kwargs))
        return Watch(events, cancel)

    # -- cluster -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        st = self._call(lambda c: c.status())
        return {"version": st.version, "db_size": st.db_size, "raft_index": st.raft_index}


def retry_unavailable(
    fn: Callable[[], T],
    what: str,
    stop: threading.Event | None = None,
    max_wait: timedelta | None = None,
) -> T:
    """Call ``fn`` until etcd answers: retry :class:`EtcdUnavailableError` with backoff.

    For the long-lived processes (agent, controller, worker) an etcd outage is
    a pause, not a crash: they keep their state and carry on when a quorum is
    back.  Other errors (auth, bad request) are raised at once.

    Args:
        fn: the etcd operation.
        what: what is being done, for the log.
        stop: give up (re-raising the last error) once this is set.
        max_wait: give up after this long (default: never).

    Raises:
        EtcdUnavailableError: ``stop`` was set or ``max_wait`` passed.
    """
    started = time.monotonic()
    delay = 0.1
    warned = False
    while True:
        try:
            result = fn()
        except EtcdUnavailableError as e:
            waited = time.monotonic() - started
            if (stop is not None and stop.is_set()) or (
                max_wait is not None and waited >= max_wait.total_seconds()
            ):
                raise
            if not warned:
                log.warning("%s: etcd unavailable, retrying until it is back: %s", what, e)
                warned = True
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF.total_seconds())
            continue
        if warned:
            log.warning("%s: etcd is back after %.1fs", what, time.monotonic() - started)
        return result


def _kv(key: str, value: bytes, meta: Any) -> KeyValue:
    return KeyValue(
        key=key,
        value=bytes(value),
        mod_revision=int(meta.mod_revision),
        create_revision=int(meta.create_revision),
        version=int(meta.version),
        lease_id=int(meta.lease_id),
    )


def connect(options: EtcdOptions) -> EtcdClient:
    """Connect to the first etcd endpoint that answers within ``connect_timeout``.

    Raises:
        EtcdUnavailableError: no endpoint answered; names every endpoint and its error.
        EtcdAuthError: an endpoint answered but refused the credentials.
        EtcdError: an endpoint is malformed or a TLS file cannot be read.
    """
    if not options.endpoints:
        raise EtcdError("no etcd endpoints given; pass --etcd host:port or set RINGMASTER_ETCD")
    creds = None
    if options.secure:
        if not options.ca_cert:
            raise EtcdError("https etcd endpoints need a CA certificate (--etcd-ca)")
        try:
            creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(
                options.ca_cert, options.key, options.cert
            )
        except OSError as e:
            raise EtcdError(f"cannot read etcd TLS file: {e}") from e
    deadline = time.monotonic() + options.connect_timeout.total_seconds()
    reasons: dict[str, str] = {}
    checked: set[str] = set()
    tls_problems: dict[str, str] = {}
    while True:
        if tls_problems and set(tls_problems) | set(reasons) >= set(options.endpoints):
            # Every endpoint failed and some for a TLS reason: that will not heal.
            raise EtcdAuthError("; ".join(tls_problems.values()))
        for ep in options.endpoints:
            host, port = _host_port(ep)
            remaining = max(deadline - time.monotonic(), 0.2)
            try:
                raw = _open(options, host, port, creds, remaining)
            except EtcdAuthError:
                raise
            except Exception as e:
                reasons[ep] = _reason(e)
                if ep not in checked:
                    checked.add(ep)
                    mismatch = tls_mismatch(options, host, port)
                    if mismatch:
                        tls_problems[ep] = mismatch
                continue
            # Re-open with every endpoint for fail-over once one is known to work.
            if len(options.endpoints) > 1:
                raw.close()
                raw = _open_all(options, creds)
            return EtcdClient(options, raw)
        if time.monotonic() >= deadline:
            raise EtcdUnavailableError(list(options.endpoints), options.connect_timeout, reasons)
        time.sleep(0.2)


def _endpoint(host: str, port: int, creds: Any) -> Any:
    return etcd3.Endpoint(
        host,
        port,
        secure=creds is not None,
        creds=creds,
        time_retry=ENDPOINT_RETRY_AFTER.total_seconds(),
    )


def _authenticate(raw: Any, options: EtcdOptions) -> None:
    """Get a token for ``options.user`` and send it as metadata with every call.

    The etcd3 library also wraps the token in gRPC call credentials, which gRPC
    refuses to send on a plain-text channel; metadata works on both.
    """
    request = etcdrpc.AuthenticateRequest(name=options.user, password=options.password)
    resp = raw.authstub.Authenticate(request, raw.timeout)
    raw.metadata = (("token", resp.token),)
    raw.call_credentials = None
    raw._stubs.pop("watcher", None)  # a watcher keeps the metadata it was made with


def _new_client(options: EtcdOptions, endpoints: list[Any], timeout: float) -> Any:
    if bool(options.user) != bool(options.password):
        missing = "--etcd-password (or RINGMASTER_ETCD_PASSWORD)" if options.user else "--etcd-user"
        raise EtcdError(f"etcd user/password auth needs both; {missing} is missing")
    raw = etcd3.MultiEndpointEtcd3Client(endpoints=endpoints, timeout=timeout, failover=True)
    if options.user:
        _authenticate(raw, options)
    return raw


def _open(options: EtcdOptions, host: str, port: int, creds: Any, timeout: float) -> Any:
    try:
        raw = _new_client(options, [_endpoint(host, port, creds)], timeout)
        raw.status()
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
            raise EtcdAuthError(
                f"etcd at {host}:{port} refused user {options.user!r}: {e.details()}; "
                "check --etcd-user and --etcd-password / RINGMASTER_ETCD_PASSWORD"
            ) from e
        raise
    raw.timeout = options.op_timeout.total_seconds()
    return raw


def _open_all(options: EtcdOptions, creds: Any) -> Any:
    endpoints = [_endpoint(*_host_port(ep), creds) for ep in options.endpoints]
    return _new_client(options, endpoints, options.op_timeout.total_seconds())


def _plain_text_reply(e: ssl.SSLError) -> bool:
    """The TLS handshake met a peer that does not speak TLS (or hung up on it)."""
    text = f"{e.reason or ''} {e}".upper()
    markers = ("WRONG_VERSION_NUMBER", "RECORD_LAYER", "PACKET_LENGTH", "UNEXPECTED_EOF", "EOF")
    return isinstance(e, ssl.SSLEOFError) or any(m in text for m in markers)


def _token_rejected(e: grpc.RpcError) -> bool:
    details = (e.details() or "").lower()
    return e.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in details


#: How long :func:`tls_mismatch` waits for a handshake or for the server to refuse it.
_TLS_PROBE_SECONDS = 1.0


def tls_mismatch(options: EtcdOptions, host: str, port: int) -> str | None:
    """Why TLS between these options and ``host:port`` cannot work, or None.

    Tries a TLS handshake the way the options describe (or, without TLS
    options, whether the server speaks TLS at all) and turns the outcome into
    one sentence naming the endpoint and the option to check.  None when the
    endpoint does not answer at all or the handshake is fine: then TLS is not
    the problem.
    """
    where = f"etcd at {host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=_TLS_PROBE_SECONDS)
    except OSError:
        return None
    with sock:
        if not options.secure:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            try:
                with ctx.wrap_socket(sock, server_hostname=host):
                    pass
            except ssl.SSLError as e:
                if _plain_text_reply(e):
                    return None  # not a TLS server: the failure is something else
            except OSError:
                return None
            return (
                f"{where} serves TLS but no TLS options were given: pass --etcd-ca "
                "(RINGMASTER_ETCD_CA) with the CA that signed its certificate, and "
                "--etcd-cert / --etcd-key if it requires client certificates"
            )
        try:
            ctx = ssl.create_default_context(cafile=options.ca_cert)
            if options.cert and options.key:
                ctx.load_cert_chain(options.cert, options.key)
        except (ssl.SSLError, OSError, ValueError) as e:
            return (
                f"{where}: cannot use the TLS files given (--etcd-ca / --etcd-cert / "
                f"--etcd-key): {e}"
            )
        try:
            with ctx.wrap_socket(sock, server_hostname=host) as tls:
                tls.settimeout(_TLS_PROBE_SECONDS)
                # TLS 1.3 servers refuse a client certificate after the handshake.
                tls.recv(1)
        except ssl.SSLCertVerificationError as e:
            return (
                f"{where}: its certificate does not verify against --etcd-ca "
                f"{options.ca_cert} ({e.verify_message}); check that --etcd-ca "
                "(RINGMASTER_ETCD_CA) is the CA that signed the server certificate and "
                f"that the certificate names {host}"
            )
        except ssl.SSLError as e:
            text = f"{e.reason or ''} {e}".upper()
            if _plain_text_reply(e):
                return (
                    f"{where} does not answer TLS (it looks like plain http): drop --etcd-ca / "
                    "--etcd-cert / --etcd-key or point --etcd at its TLS client endpoint"
                )
            if "CERTIFICATE" in text or "UNKNOWN_CA" in text or "ALERT" in text:
                given = options.cert or "none given"
                return (
                    f"{where} refused the client certificate ({given}): check --etcd-cert / "
                    "--etcd-key (RINGMASTER_ETCD_CERT / RINGMASTER_ETCD_KEY); etcd wants one "
                    "signed by its --trusted-ca-file"
                )
            return (
                f"{where}: TLS handshake failed ({e.reason or e}); check the --etcd-ca / "
                "--etcd-cert / --etcd-key files"
            )
        except (TimeoutError, OSError):
            return None  # the server accepted us and waited for a request: TLS is fine
    return None


def _reason(e: Exception) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    name = type(e).__name__
    text = str(e)
    return f"{name}: {text}" if text else name
