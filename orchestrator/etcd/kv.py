"""What the etcd client hands out: key-values, watch events, watches and leases.

In whichever process holds a client.  Values are ``bytes``.  A :class:`Lease`
refreshes itself in a daemon thread once asked to (:meth:`Lease.keep_alive`,
the one keep-alive loop of ringmaster: node registrations, the controller's
leadership, rendezvous runs) and rides out etcd outages: etcd extends every
lease by its TTL when a new raft leader is elected.  A lease reaches etcd
only through the client's public lease calls (:class:`LeaseCalls`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import etcd3
import etcd3.exceptions as etcd_exc

from orchestrator.api import EtcdError
from orchestrator.etcd.diagnosis import EtcdCompactedError

__all__ = [
    "KeyValue",
    "Lease",
    "LeaseCalls",
    "Watch",
    "WatchEvent",
    "compacted_watch",
    "from_proto",
    "key_value",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyValue:
    """A key with its value and revisions."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease_id: int


def key_value(key: str, value: bytes, meta: Any) -> KeyValue:
    """A :class:`KeyValue` from the value and metadata the etcd3 library returns."""
    return KeyValue(
        key=key,
        value=bytes(value),
        mod_revision=int(meta.mod_revision),
        create_revision=int(meta.create_revision),
        version=int(meta.version),
        lease_id=int(meta.lease_id),
    )


def from_proto(kv: Any, key: str | None = None) -> KeyValue:
    """A :class:`KeyValue` from etcd's own ``mvccpb.KeyValue`` (``key``: its key, decoded)."""
    return KeyValue(
        key=bytes(kv.key).decode() if key is None else key,
        value=bytes(kv.value),
        mod_revision=int(kv.mod_revision),
        create_revision=int(kv.create_revision),
        version=int(kv.version),
        lease_id=int(kv.lease),
    )


@dataclass(frozen=True)
class WatchEvent:
    """A put (``value`` set) or delete (``value`` is None) seen by a watch."""

    key: str
    value: bytes | None
    mod_revision: int

    @property
    def deleted(self) -> bool:
        return self.value is None


class Watch:
    """A running watch; iterate it for events, ``cancel()`` to stop."""

    def __init__(self, events: Iterator[Any], cancel: Callable[[], None]) -> None:
        self._events = events
        self._cancel = cancel

    def __iter__(self) -> Iterator[WatchEvent]:
        """The events as they come; ends when the watch is cancelled or its stream ends.

        Raises:
            EtcdCompactedError: etcd compacted its history past what this watch
                had still to send (it fell that far behind); the watch is over.
            Exception: the stream broke (etcd3's connection errors).
        """
        try:
            for ev in self._events:
                value = None if isinstance(ev, etcd3.events.DeleteEvent) else bytes(ev.value)
                yield WatchEvent(ev.key.decode(), value, int(ev.mod_revision))
        except etcd_exc.RevisionCompactedError as e:
            raise compacted_watch(e) from e

    def cancel(self) -> None:
        self._cancel()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def compacted_watch(e: etcd_exc.RevisionCompactedError) -> EtcdCompactedError:
    """The named error for a watch whose revisions etcd has compacted away."""
    return EtcdCompactedError(
        f"etcd compacted its history up to revision {e.compacted_revision}, "
        "past the revision a watch was to start from"
    )


class LeaseCalls(Protocol):
    """What a :class:`Lease` needs of the client (:class:`~orchestrator.etcd.client.EtcdClient`)."""

    def refresh_lease(self, lease_id: int) -> int:
        """Refresh once; the TTL granted, ``<= 0`` when the lease is gone."""
        ...

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease: its keys vanish at once."""
        ...

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds the lease has left, -1 when it is gone."""
        ...


class Lease:
    """An etcd lease; keys put with it vanish when it expires or is revoked.

    Granted by :meth:`~orchestrator.etcd.client.EtcdClient.lease`.
    """

    def __init__(self, client: LeaseCalls, lease_id: int, ttl: int) -> None:
        self._client = client
        self._id = int(lease_id)
        self.ttl = ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def id(self) -> int:
        return self._id

    def refresh(self) -> int:
        """Refresh once; returns the TTL granted, ``<= 0`` when the lease is gone."""
        return self._client.refresh_lease(self.id)

    def revoke(self) -> None:
        """Stop the keep-alive and revoke the lease (a failure is logged: it expires anyway)."""
        self.stop_keepalive()
        try:
            self._client.revoke_lease(self.id)
        except EtcdError as e:  # the lease expires on its own anyway
            log.debug("revoking lease %x failed: %s", self.id, e)

    def remaining(self) -> int:
        """Seconds left, or -1 when the lease is gone."""
        return self._client.lease_ttl(self.id)

    def keep_alive(
        self,
        interval: float | None = None,
        on_lost: Callable[[Lease], None] | None = None,
        on_refreshed: Callable[[Lease, float], None] | None = None,
    ) -> None:
        """Refresh in a daemon thread every ``interval`` s (default ttl/3) until stopped.

        Failed refreshes (etcd unreachable, no quorum, a refusal) are retried:
        etcd extends every lease by its TTL when a new raft leader is elected,
        so a lease usually outlives an outage, and whether it did is known
        only once etcd answers.  A holder that must know how long the lease
        surely lives (a leader) passes ``on_refreshed(lease, sent)``: called
        after each refresh etcd granted, with the ``time.monotonic()`` at which
        that refresh was sent (the lease lives at least its TTL from then).
        When etcd answers that the lease is gone, ``on_lost(lease)`` is called
        once and the thread ends.  A second call while the thread runs does nothing.
        """
        if self._thread is not None:
            return
        every = interval if interval is not None else max(self.ttl / 3.0, 0.2)
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._keep_alive,
            args=(every, on_lost, on_refreshed),
            name=f"lease-{self.id:x}",
            daemon=True,
        )
        self._thread.start()

    def _keep_alive(
        self,
        every: float,
        on_lost: Callable[[Lease], None] | None,
        on_refreshed: Callable[[Lease, float], None] | None,
    ) -> None:
        failing = False
        while not self._stop.wait(every):
            sent = time.monotonic()
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
            if on_refreshed is not None and not self._stop.is_set():
                on_refreshed(self, sent)

    def stop_keepalive(self) -> None:
        """Stop refreshing (waits up to a second for the thread, unless called from it)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)
