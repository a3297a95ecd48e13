"""Leader election through an etcd lease.

The leader holds its election key (``/ringmaster/controller/leader``, or the
one of its job for controllers of one job) under a lease it keeps
alive.  A standby waits; when the leader dies its lease expires (within the
TTL), the key vanishes and the first standby to create it leads.  A leader
that cannot refresh its lease (partitioned, or etcd without quorum) knows it
is no longer leader by the lease's own deadline and stops acting; it leads
again if the lease survived once etcd answers, and campaigns afresh if not.
The lease is kept alive by its own loop (:meth:`~orchestrator.etcd.kv.Lease.keep_alive`),
which tells the election when each refresh was sent and when the lease is gone.
Runs in the controller (and in the CLI's local run, which hosts one).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta

from orchestrator import keys
from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.kv import Lease
from orchestrator.settings import SETTINGS

__all__ = ["DEFAULT_LEADER_TTL", "LeaderElection"]

log = logging.getLogger(__name__)

#: Leader lease; a standby takes over at most this long after the leader dies.
DEFAULT_LEADER_TTL = SETTINGS.leader_ttl


class LeaderElection:
    """Campaign for leadership; ``is_leader`` stays true while the lease is fresh."""

    def __init__(
        self,
        client: EtcdClient,
        identity: str | None = None,
        ttl: timedelta = DEFAULT_LEADER_TTL,
        key: str | None = None,
    ) -> None:
        self.client = client
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        self.ttl = ttl
        self.key = key or keys.controller_leader()
        self._lease: Lease | None = None
        self._valid_until = 0.0

    @property
    def is_leader(self) -> bool:
        return self._lease is not None and time.monotonic() < self._valid_until

    def try_acquire(self) -> bool:
        """One attempt: True when this process now leads."""
        if self.is_leader:
            return True
        if self._lease is not None:
            return False  # our lease is being refreshed; it leads again once etcd answers
        lease = self.client.lease(max(int(self.ttl.total_seconds()), 2))
        if self.client.create(self.key, self.identity, lease=lease):
            self._lease = lease
            self._valid_until = time.monotonic() + self.ttl.total_seconds() * 0.8
            lease.keep_alive(
                interval=self.ttl.total_seconds() / 3,
                on_lost=self._lost,
                on_refreshed=self._refreshed,
            )
            log.warning("%s is now the leader", self.identity)
            return True
        lease.revoke()
        return False

    def wait_for_leadership(self, stop: threading.Event, poll: float = 0.2) -> bool:
        """Block until leader (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            try:
                if self.try_acquire():
                    return True
            except EtcdError as e:
                log.warning("election: %s", e)
            stop.wait(poll)
        return False

    def current_leader(self) -> str | None:
        kv = self.client.get(self.key)
        return kv.value.decode() if kv else None

    def _refreshed(self, lease: Lease, sent: float) -> None:
        """The lease was refreshed by a request sent at ``sent``: lead until 0.8 TTL past it.

        While etcd is away no refresh comes, so ``is_leader`` lapses with the
        deadline; the lease may well survive the outage (etcd extends leases
        when a new raft leader is elected), and leading resumes with the next refresh.
        """
        if lease is self._lease:
            self._valid_until = sent + self.ttl.total_seconds() * 0.8

    def _lost(self, lease: Lease) -> None:
        """etcd answered that the leader lease is gone: campaign afresh."""
        if lease is self._lease:
            log.warning("%s lost leadership: the leader lease expired", self.identity)
            self._lease = None

    def resign(self) -> None:
        """Stop leading: revoke the lease, so a standby takes over at once."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.revoke()
