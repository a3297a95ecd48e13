"""What the etcd client hands out: key-values, watch events, watches and leases.

Values are ``bytes``.  A :class:`Lease` refreshes itself in a daemon thread
once asked to (:meth:`Lease.keep_alive`) and rides out etcd outages: etcd
extends every lease by its TTL when a new raft leader is elected.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import etcd3

from orchestrator.api import EtcdError

if TYPE_CHECKING:
    from orchestrator.etcd.client import EtcdClient

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
        for ev in self._events:
            value = None if isinstance(ev, etcd3.events.DeleteEvent) else bytes(ev.value)
            yield WatchEvent(ev.key.decode(), value, int(ev.mod_revision))

    def cancel(self) -> None:
        self._cancel()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


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
