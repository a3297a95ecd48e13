"""The etcd client: every etcd call of ringmaster goes through :class:`EtcdClient`.

In every process of ringmaster that talks to etcd (the controller, node
agents, workers, the CLI, the operator).  It is a facade over the ``etcd3``
v3-API client (installed from the ``cslab-etcd3`` distribution) with what the
rest of ringmaster needs and nothing else, put together from parts with one
job each:

* :mod:`orchestrator.etcd.transport`: every call, with fail-over between
  members, retries within the operation timeout, named refusals, and the
  outage bookkeeping (:attr:`EtcdClient.last_silence`,
  :meth:`EtcdClient.unreachable_for`).  A single member going down is
  invisible to callers; a write etcd refuses for want of space (NOSPACE)
  counts as etcd being away until a write goes through again.
* :mod:`orchestrator.etcd.ranges`: reads of a prefix in pages at one revision.
* :mod:`orchestrator.etcd.transactions`: compare-and-set (the primitive
  rendezvous, leader election and fencing are built from), fenced writes,
  many keys read or written at once, and the size check of every write.
* :mod:`orchestrator.etcd.maintenance`: status, alarms, compaction, defragmentation.

Values are ``bytes`` in, ``bytes`` out.  :func:`connect` tries every endpoint
within a connect timeout and fails with an
:class:`~orchestrator.api.EtcdUnavailableError` naming each endpoint tried and
why, or at once with an :class:`~orchestrator.api.EtcdAuthError` when TLS or
the credentials cannot work (:mod:`orchestrator.etcd.diagnosis`).

Options are in :mod:`orchestrator.etcd.options`, the values handed out in
:mod:`orchestrator.etcd.kv`, following a key through outages in
:mod:`orchestrator.etcd.watch`, waiting out outages in
:mod:`orchestrator.etcd.retry`.  Importing this module sets no environment
variable; the gRPC settings of ringmaster's own processes are in
:mod:`orchestrator.etcd.grpc_env`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import etcd3.exceptions as etcd_exc

from orchestrator.etcd import channel
from orchestrator.etcd import quorum as quorum_mod
from orchestrator.etcd.kv import KeyValue, Lease, Watch, compacted_watch, from_proto, key_value
from orchestrator.etcd.maintenance import DEFRAGMENT_TIMEOUT, Maintenance
from orchestrator.etcd.members import Members
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.ranges import RangeReader
from orchestrator.etcd.transactions import Transactions, check_request_size
from orchestrator.etcd.transport import EtcdTransport

__all__ = ["EtcdClient", "connect"]


def _encoded(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _lease_id(lease: Lease | None) -> int | None:
    return lease.id if lease is not None else None


class EtcdClient:
    """A connected etcd client with fail-over.  Build it with :func:`connect`.

    Args:
        options: endpoints, credentials and timeouts.
        raw: the members to talk to (:class:`~orchestrator.etcd.members.Members`),
            or one raw client of the etcd3 library (tests).
    """

    def __init__(self, options: EtcdOptions, raw: Any) -> None:
        #: every call goes through it; for a call this facade has no method for
        self.transport = EtcdTransport(options, raw)
        self.ranges = RangeReader(self.transport)
        self.transactions = Transactions(self.transport)
        self.maintenance = Maintenance(self.transport)

    # -- the connection ----------------------------------------------------------------

    @property
    def options(self) -> EtcdOptions:
        return self.transport.options

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.transport.endpoints

    @property
    def members(self) -> Members:
        """The members, the one in use, and how each has been answering."""
        return self.transport.members

    @property
    def last_success(self) -> float:
        """``time.monotonic()`` of the last time etcd showed it had a quorum."""
        return self.transport.last_success

    @property
    def last_silence(self) -> tuple[float, float] | None:
        """``(monotonic end, seconds)`` of the last time etcd kept this client's calls
        waiting or failing for long: an outage or a stall of etcd, during which
        leases may have expired for reasons of etcd's own."""
        return self.transport.last_silence

    def unreachable_for(self) -> float:
        """How long etcd has been away for this client (0: all is well); see
        :meth:`~orchestrator.etcd.transport.EtcdTransport.unreachable_for`."""
        return self.transport.unreachable_for()

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- key/value ---------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        value, meta = self.transport.call(lambda c: c.get(key))
        if meta is None:
            return None
        return key_value(key, value, meta)

    def get_with_revision(self, key: str) -> tuple[KeyValue | None, int]:
        """Read ``key`` and the store revision the read saw (to watch from without gaps)."""
        resp = self.transport.call(lambda c: c.get_response(key))
        revision = int(resp.header.revision)
        if not resp.kvs:
            return None, revision
        return from_proto(resp.kvs[0], key), revision

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """All keys under ``prefix`` with their values, sorted by key.

        Read in pages of about :data:`~orchestrator.etcd.ranges.PAGE_BYTES`,
        every page at the revision of the first: one consistent snapshot,
        however many keys and bytes.
        """
        return self.ranges.prefix(prefix)[0]

    def get_prefix_with_revision(self, prefix: str) -> tuple[list[KeyValue], int]:
        """:meth:`get_prefix` and the revision it was read at (to watch from without gaps)."""
        return self.ranges.prefix(prefix)

    def get_keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, sorted, without their values (paged, one snapshot)."""
        return [kv.key for kv in self.ranges.prefix(prefix, keys_only=True)[0]]

    def child_names(self, prefix: str) -> list[str]:
        """The distinct first segments of the keys under ``prefix``, sorted
        (:meth:`~orchestrator.etcd.ranges.RangeReader.child_names`)."""
        return self.ranges.child_names(prefix)

    def count_prefix(self, prefix: str) -> int:
        """How many keys live under ``prefix`` (counted by etcd, values not sent)."""
        return self.ranges.count(prefix)

    def put(self, key: str, value: bytes | str, lease: Lease | None = None) -> int:
        """Write ``key``; returns the new revision.

        Raises:
            EtcdRequestTooLargeError: key and value are over etcd's request limit
                (checked here: nothing is sent).
            EtcdNoSpaceError: etcd's database is full (NOSPACE alarm).
        """
        data = _encoded(value)
        check_request_size(key, data)
        resp = self.transport.call(
            lambda c: c.put(key, data, lease=_lease_id(lease)),
            write=True,
            what=f" writing {key}",
        )
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        return bool(self.transport.call(lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        resp = self.transport.call(lambda c: c.delete_prefix(prefix))
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
        return self.ranges.keep_newest(prefix, keep, slack)

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
        return self.transactions.compare_and_set(
            key, _encoded(value), expected_mod_revision, _lease_id(lease)
        )

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
        return self.transactions.compare_value_and_set(
            key, expected_value, _encoded(value), _lease_id(lease)
        )

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
        return self.transactions.put_guarded(
            key, _encoded(value), guard_key, guard_mod_revision, _lease_id(lease)
        )

    def get_many(self, keys: list[str]) -> dict[str, KeyValue]:
        """Read several keys; the result holds those that exist.

        Read in transactions of up to
        :data:`~orchestrator.etcd.transactions.MAX_TXN_OPS` keys, all at the
        revision of the first: one consistent snapshot.  A batch whose answer
        is over the gRPC receive limit is read again in halves.
        """
        return self.transactions.get_many(keys)

    def put_many(self, items: list[tuple[str, bytes]], lease: Lease | None = None) -> None:
        """Write several keys, atomically per batch.

        A batch holds up to :data:`~orchestrator.etcd.transactions.MAX_TXN_OPS`
        keys and about :data:`~orchestrator.etcd.ranges.PAGE_BYTES` (a
        key-value larger than that is a batch of its own).

        Raises:
            EtcdRequestTooLargeError: one key-value is over etcd's request limit
                (checked before anything is written).
        """
        self.transactions.put_many(items, _lease_id(lease))

    # -- leases ------------------------------------------------------------------------

    def lease(self, ttl: int) -> Lease:
        """Grant a lease of ``ttl`` seconds (etcd's minimum effective TTL is a few seconds)."""
        raw = self.transport.call(lambda c: c.lease(int(ttl)), write=True, what=" granting a lease")
        return Lease(self, int(raw.id), int(ttl))

    def refresh_lease(self, lease_id: int) -> int:
        """Refresh a lease once; the TTL granted, ``<= 0`` when the lease is gone."""
        responses = self.transport.call(lambda c: list(c.refresh_lease(lease_id)))
        return int(responses[-1].TTL) if responses else -1

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease: the keys put with it vanish at once."""
        self.transport.call(lambda c: c.revoke_lease(lease_id))

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds a lease has left, -1 when it is gone."""
        return int(self.transport.call(lambda c: c.get_lease_info(lease_id)).TTL)

    # -- watches -----------------------------------------------------------------------

    def watch(self, key: str, *, prefix: bool = False, start_revision: int | None = None) -> Watch:
        """Watch a key (or every key under a prefix) from ``start_revision`` on.

        To follow a key through etcd's outages, use
        :class:`~orchestrator.etcd.watch.KeyFollower`.

        Raises:
            EtcdCompactedError: ``start_revision`` is compacted away.
            EtcdError: as for any call.
        """
        kwargs: dict[str, Any] = {}
        if start_revision is not None:
            kwargs["start_revision"] = start_revision

        def create(c: Any) -> Any:
            try:
                return c.watch_prefix(key, **kwargs) if prefix else c.watch(key, **kwargs)
            except etcd_exc.RevisionCompactedError as e:
                raise compacted_watch(e) from e

        events, cancel = self.transport.call(create, quorum=False)
        return Watch(events, cancel)

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

        done = self.transport.call(watch, timeout=timeout + self.options.op_timeout, quorum=False)
        return done is not None

    # -- cluster (orchestrator.etcd.maintenance) ---------------------------------------

    def status(self) -> dict[str, Any]:
        """The status of the member calls go to: version, database size, raft index."""
        return self.maintenance.status()

    def db_sizes(self, timeout: timedelta = quorum_mod.PROBE_TIMEOUT) -> dict[str, int]:
        """Each member's database size in bytes (members that did not answer
        within ``timeout`` are left out)."""
        return self.maintenance.db_sizes(timeout)

    def alarms(self) -> list[tuple[int, str]]:
        """The alarms raised in the cluster: ``(member id, kind)``."""
        return self.maintenance.alarms()

    def no_space(self) -> bool:
        """etcd refuses writes for want of space: a NOSPACE alarm is raised."""
        return self.maintenance.no_space()

    def check_writable(self) -> None:
        """Raise ``EtcdNoSpaceError`` while etcd refuses writes for want of space."""
        self.maintenance.check_writable()

    def current_revision(self) -> int:
        """etcd's current revision (that of its newest write)."""
        return self.maintenance.current_revision()

    def compact(self, revision: int | None = None) -> int:
        """Compact etcd's history up to ``revision`` (default: the current one); returns it."""
        return self.maintenance.compact(revision)

    def defragment(self, timeout: timedelta = DEFRAGMENT_TIMEOUT) -> None:
        """Defragment every member's database, one after another."""
        self.maintenance.defragment(timeout)

    def disarm_no_space(self) -> int:
        """Disarm every NOSPACE alarm (after space was freed); returns how many."""
        return self.maintenance.disarm_no_space()


def connect(options: EtcdOptions) -> EtcdClient:
    """Connect to the first etcd endpoint that answers within ``connect_timeout``.

    Raises:
        EtcdUnavailableError: no endpoint answered; names every endpoint and its error.
        EtcdAuthError: an endpoint answered but refused the credentials, or TLS
            between the options and every endpoint that answered cannot work.
        EtcdError: an endpoint is malformed or a TLS file cannot be read.
    """
    return EtcdClient(options, channel.open_client(options))
