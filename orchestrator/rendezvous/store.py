"""A c10d ``Store`` on etcd v3, so that no node has to host the store.

torch elastic hands every agent a key-value store for the work around a
rendezvous round (the master address, rank assignment, the exit barrier).
torch's ``c10d`` backend keeps that store in a ``TCPStore`` served by one
agent; when that node dies the store dies with it and so does the job.
:class:`EtcdStore` keeps the keys in etcd instead, which outlives any node.

It is a Python subclass of :class:`torch.distributed.Store`, so it works
wherever torch takes a store (``PrefixStore``, ``init_process_group``,
torch elastic).  Keys are ``<prefix><key>``, values raw bytes.  Reads that
must block (``get``, ``wait``, ``multi_get``) read once and then watch the
missing key from the revision they read at, so a write is never missed and
nobody polls.  Counters (``add``) are decimal strings updated by
compare-and-set on ``mod_revision``, as ``TCPStore`` keeps them.

Keys can carry a :class:`RunLease`, a long lease kept alive while its
process lives, so that the keys of an abandoned run expire instead of piling
up in etcd.

torch's whole store contract holds, from Python and through C++ (see
``docs/etcd-store.md``).  ``clone()`` shares the client and the lease; the
store keeps every clone it hands out, because torch calls ``clone`` from C++
and keeps only the C++ half of the answer.  Queues (``queue_push``,
``queue_pop``, ``queue_len``) are in :mod:`orchestrator.rendezvous.store_queues`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from etcd3.utils import prefix_range_end

from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.diagnosis import EtcdCompactedError, EtcdLeaseNotFoundError
from orchestrator.etcd.kv import KeyValue, Lease
from orchestrator.rendezvous.store_queues import LeasedWrite, StoreQueues, queue_root
from orchestrator.settings import SETTINGS

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long blocking reads wait for a key by default (``c10d``'s default store timeout).
DEFAULT_STORE_TIMEOUT = SETTINGS.store_timeout
#: How long the keys of a run outlive the last process that kept them alive.
DEFAULT_RUN_TTL = SETTINGS.rdzv_ttl


class EtcdStoreTimeoutError(dist.DistStoreError):
    """Keys did not appear within the store timeout (what ``TCPStore`` raises too)."""


class EtcdStoreConnectionError(dist.DistNetworkError):
    """etcd could not be reached; the message names the endpoints."""


#: What torch's stores raise for a non-blocking pop of an empty queue (where torch has it).
_QueueEmptyBase: type[dist.DistStoreError] = getattr(dist, "QueueEmptyError", dist.DistStoreError)


class EtcdStoreQueueEmptyError(_QueueEmptyBase):  # type: ignore[valid-type,misc]
    """``queue_pop(key, block=False)`` found the queue empty (a ``dist.QueueEmptyError``)."""


class RunLease:
    """One long etcd lease per process for the keys of a run.

    Every write of a run's keys (rendezvous state, store keys) attaches this
    lease, and a daemon thread keeps it alive while the process lives.  A key
    therefore lives as long as the last process that wrote it, plus ``ttl``:
    keys of a running job never expire, those of an abandoned one go away.

    Args:
        client: the etcd client.
        ttl: lifetime after the process stops refreshing; zero or less
            disables the lease (keys are permanent).
    """

    def __init__(self, client: EtcdClient, ttl: timedelta = DEFAULT_RUN_TTL) -> None:
        self._client = client
        self.ttl = ttl
        self._lease: Lease | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.ttl.total_seconds() > 0

    def current(self) -> Lease | None:
        """The lease to attach to writes, granted on first use; None when disabled."""
        if not self.enabled:
            return None
        with self._lock:
            if self._lease is None:
                seconds = max(int(self.ttl.total_seconds()), 1)
                self._lease = self._client.lease(seconds)
                self._lease.keep_alive(interval=max(seconds / 3.0, 0.5))
            return self._lease

    def _replace(self, stale: Lease | None) -> None:
        with self._lock:
            if self._lease is stale and stale is not None:
                stale.stop_keepalive()
                self._lease = None

    def write(self, fn: Callable[[Lease | None], T]) -> T:
        """Run a write with the lease; if etcd lost the lease, grant a new one and retry once."""
        lease = self.current()
        try:
            return fn(lease)
        except EtcdLeaseNotFoundError:
            if lease is None:
                raise
            log.info("run lease %x expired; granting a new one", lease.id)
        self._replace(lease)
        return fn(self.current())

    def close(self) -> None:
        """Stop refreshing (the keys expire ``ttl`` later unless another process refreshes)."""
        with self._lock:
            if self._lease is not None:
                self._lease.stop_keepalive()
                self._lease = None


def _leased_writer(lease: RunLease | None) -> LeasedWrite:
    """Runs a write with ``lease`` (:meth:`RunLease.write`), or without one when None."""

    def write(fn: Callable[[Lease | None], T]) -> T:
        return fn(None) if lease is None else lease.write(fn)

    return write


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live in etcd under ``prefix``.

    Args:
        client: a connected etcd client (shared; the store does not close it).
        prefix: key prefix, e.g. :func:`orchestrator.state.keys.rdzv_store`; a
            trailing ``/`` is added when missing.
        timeout: default deadline of blocking reads (``get``, ``wait``,
            ``multi_get``); ``set_timeout`` changes it as on any store.
        lease: a :class:`RunLease` attached to every write, or None for
            permanent keys.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: timedelta = DEFAULT_STORE_TIMEOUT,
        lease: RunLease | None = None,
    ) -> None:
        super().__init__()
        self._client = client
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._lease = lease
        # The queues get a writer that does not hold this store: no reference cycle,
        # so a store (a clone above all) goes when its last reference does.
        self._queues = StoreQueues(client, queue_root(self.prefix), _leased_writer(lease))
        #: every clone handed out, kept alive for C++ callers (see :meth:`clone`)
        self._clones: list[EtcdStore] = []
        self.set_timeout(timeout)

    def __repr__(self) -> str:
        return f"EtcdStore({', '.join(self._client.endpoints)}, prefix={self.prefix!r})"

    # -- plumbing ----------------------------------------------------------------------

    @property
    def default_timeout(self) -> timedelta:
        """The store timeout (what ``set_timeout`` last set)."""
        value: timedelta = self.timeout  # type: ignore[attr-defined]
        return value

    def _key(self, key: str) -> str:
        return self.prefix + key

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except EtcdError as e:
            raise EtcdStoreConnectionError(
                f"etcd store {what} failed: etcd at {', '.join(self._client.endpoints)} "
                f"(prefix {self.prefix}): {e}"
            ) from e

    def _write(self, fn: Callable[[Lease | None], T]) -> T:
        if self._lease is None:
            return fn(None)
        return self._lease.write(fn)

    def _wait_for(self, keys: list[str], timeout: timedelta) -> dict[str, KeyValue]:
        """Block until every key in ``keys`` exists; return them by store key."""
        full = [self._key(k) for k in keys]
        deadline = time.monotonic() + max(timeout.total_seconds(), 0.0)
        while True:
            found = self._client.get_many(full)
            missing = [k for k in full if k not in found]
            if not missing:
                return {k: found[self._key(k)] for k in keys}
            kv, revision = self._client.get_with_revision(missing[0])
            if kv is not None:
                continue  # appeared since the batch read
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timed_out([k[len(self.prefix) :] for k in missing], timeout)
            self._client.wait_for_change(missing[0], revision, timedelta(seconds=remaining))

    def _timed_out(self, keys: list[str], timeout: timedelta) -> EtcdStoreTimeoutError:
        return EtcdStoreTimeoutError(
            f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: {keys} "
            f"(etcd store {self.prefix} at {', '.join(self._client.endpoints)}); "
            "the ranks that set them are late or gone, or the store timeout is too short"
        )

    def _missing(self, keys: list[str], first_only: bool = False) -> list[str]:
        """The names in ``keys`` that are neither a key nor a non-empty queue now.

        One read for the keys; a queue is read only for a name without a key
        (up to the first missing one with ``first_only``).
        """
        found = self._client.get_many([self._key(k) for k in keys])
        missing: list[str] = []
        for k in keys:
            if self._key(k) not in found and not self._queues.nonempty(k):
                missing.append(k)
                if first_only:
                    break
        return missing

    def _wait_for_names(self, keys: list[str], timeout: timedelta) -> None:
        """Block until every name in ``keys`` is a key or a non-empty queue (``wait``)."""
        deadline = time.monotonic() + max(timeout.total_seconds(), 0.0)
        while True:
            missing = self._missing(keys, first_only=True)
            if not missing:
                return
            first = missing[0]
            kv, revision = self._client.get_with_revision(self._key(first))
            try:
                if kv is not None or self._queues.nonempty(first, revision):
                    continue  # appeared since the batch read
            except EtcdCompactedError:
                continue  # the revision just read is compacted already: read again
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timed_out(self._missing(keys) or [first], timeout)
            items = self._queues.items(first)
            self._queues.watch(
                [(self._key(first), None), (items, prefix_range_end(items.encode()))],
                revision,
                remaining,
            )

    # -- the Store interface -----------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        data = _as_bytes(value)
        with self._errors("set"):
            self._write(lambda lease: self._client.put(self._key(key), data, lease=lease))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set.

        Raises:
            EtcdStoreTimeoutError: the key did not appear in time.
            EtcdStoreConnectionError: etcd could not be reached.
        """
        with self._errors("get"):
            return self._wait_for([key], self.default_timeout)[key].value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self._errors("multi_get"):
            found = self._wait_for(list(keys), self.default_timeout)
        return [found[k].value for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        items = [(self._key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)]
        with self._errors("multi_set"):
            self._write(lambda lease: self._client.put_many(items, lease=lease))

    def _swap(self, key: str, update: Callable[[bytes | None], bytes]) -> bytes:
        """Replace the value at ``key`` with ``update(old)`` by compare-and-set; retry on races."""
        full = self._key(key)
        current = self._client.get(full)
        while True:
            new = update(None if current is None else current.value)
            expected = None if current is None else current.mod_revision

            def cas(lease: Lease | None, new: bytes = new, expected: int | None = expected) -> Any:
                return self._client.compare_and_set(full, new, expected, lease)

            ok, current = self._write(cas)
            if ok:
                return new

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 when absent); returns the new value."""

        def plus(old: bytes | None) -> bytes:
            return str(int((old or b"0").decode() or "0") + int(amount)).encode()

        with self._errors("add"):
            return int(self._swap(key, plus))

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; ``TCPStore`` rules.

        An empty ``expected_value`` also matches a missing key.  Returns the
        value the key holds afterwards; for a missing key and a non-empty
        ``expected_value``, returns ``expected_value`` (as ``TCPStore`` does).
        """
        full = self._key(key)
        expected = _as_bytes(expected_value)
        desired = _as_bytes(desired_value)
        with self._errors("compare_set"):
            while True:
                if not expected:
                    created = self._write(
                        lambda lease: self._client.compare_and_set(full, desired, None, lease)
                    )[0]
                    if created:
                        return desired
                ok, current = self._write(
                    lambda lease: self._client.compare_value_and_set(full, expected, desired, lease)
                )
                if ok:
                    return desired
                if current is not None:
                    return current.value
                if expected:
                    return expected
                # The key was deleted between the two transactions: try again.

    def append(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to the bytes at ``key`` (created when absent)."""
        data = _as_bytes(value)
        with self._errors("append"):
            self._swap(key, lambda old: (old or b"") + data)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists, up to ``timeout`` (the store timeout when None).

        Raises:
            EtcdStoreTimeoutError: some key did not appear in time.
        """
        with self._errors("wait"):
            self._wait_for_names(list(keys), self.default_timeout if timeout is None else timeout)

    def check(self, keys: list[str]) -> bool:
        """True when every name is a key or a non-empty queue right now (no waiting)."""
        with self._errors("check"):
            return not self._missing(list(keys), first_only=True)

    def delete_key(self, key: str) -> bool:
        with self._errors("delete_key"):
            return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        with self._errors("num_keys"):
            return self._client.count_prefix(self.prefix)

    def list_keys(self) -> list[str]:
        with self._errors("list_keys"):
            return [kv.key[len(self.prefix) :] for kv in self._client.get_prefix(self.prefix)]

    def clone(self) -> EtcdStore:
        """Another handle on the same keys and queues, with a timeout of its own.

        It shares the client and the lease.  This store keeps a reference to
        it: torch calls ``clone`` from C++ and keeps only the C++ half of the
        answer, whose Python half (the methods C++ calls into) would otherwise
        be freed at once.  The clone therefore lives as long as this store.
        """
        twin = EtcdStore(self._client, self.prefix, self.default_timeout, self._lease)
        self._clones.append(twin)
        return twin

    # -- queues (orchestrator.rendezvous.store_queues) ---------------------------------

    def queue_push(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to the queue ``key`` (created when absent)."""
        data = _as_bytes(value)
        with self._errors("queue_push"):
            self._queues.push(key, data)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Take the oldest item of the queue ``key``.

        Args:
            key: the queue.
            block: wait up to the store timeout for an item when the queue is
                empty; False: raise at once.

        Raises:
            EtcdStoreQueueEmptyError: ``block=False`` and the queue is empty.
            EtcdStoreTimeoutError: the queue stayed empty for the store timeout.
            EtcdStoreConnectionError: etcd could not be reached.
        """
        timeout = self.default_timeout
        with self._errors("queue_pop"):
            item = self._queues.pop(key, block, timeout)
        if item is not None:
            return item
        where = f"(etcd store {self.prefix} at {', '.join(self._client.endpoints)})"
        if not block:
            raise EtcdStoreQueueEmptyError(
                f"queue is empty: {key!r} {where}; push to it first, or pop with block=True"
            )
        raise EtcdStoreTimeoutError(
            f"queue_pop timeout after {timeout.total_seconds() * 1000:.0f}ms, queue {key!r} "
            f"stayed empty {where}; the pushers are late or gone, or the store timeout is "
            "too short"
        )

    def queue_len(self, key: str) -> int:
        """How many items the queue ``key`` holds (0 when it never existed)."""
        with self._errors("queue_len"):
            return self._queues.length(key)

    def has_extended_api(self) -> bool:
        """True: ``append``, ``multi_get`` and ``multi_set`` are the store's own."""
        return True

    # C++ callers (PrefixStore, process groups) reach these under their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys
