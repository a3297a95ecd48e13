"""Leader election through an etcd lease.

The leader holds its election key under a lease it keeps alive: a job's
key (``/ringmaster/controller/jobs/<job>/leader``) for whatever controller
decides that job, one started for that job or one of every job
(:class:`JobLeadership` campaigns for each job on that same key), and
``/ringmaster/controller/leader`` for the duties of the controller of
every job (compaction, its metrics endpoint).  A standby waits; when the
leader dies its lease expires (within the TTL), the key vanishes and the
first standby to create it leads.  A leader that cannot refresh its lease
(partitioned, or etcd without quorum) knows it is no longer leader by the
lease's own deadline and stops acting; it leads again if the lease survived
once etcd answers, and campaigns afresh if not.
The lease is kept alive by its own loop (:meth:`~orchestrator.etcd.kv.Lease.keep_alive`),
which tells the election when each refresh was sent and when the lease is gone.
Runs in the controller (and in the CLI's local run, which hosts one).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.kv import Lease
from orchestrator.settings import SETTINGS
from orchestrator.state import keys

__all__ = ["DEFAULT_LEADER_TTL", "JobLeadership", "LeaderElection"]

log = logging.getLogger(__name__)

#: Leader lease; a standby takes over at most this long after the leader dies.
DEFAULT_LEADER_TTL = SETTINGS.leader_ttl

#: Terms are numbered across every election of the process, so a term names one
#: leadership even where an election object was replaced.
_TERMS = itertools.count(1)


class LeaderElection:
    """Campaign for leadership; ``is_leader`` stays true while the lease is fresh."""

    def __init__(
        self,
        client: EtcdClient,
        identity: str | None = None,
        ttl: timedelta = DEFAULT_LEADER_TTL,
        key: str | None = None,
        what: str = "",
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        self.ttl = ttl
        self.key = key or keys.controller_leader()
        #: what it leads, for its log lines ("of job x")
        self.what = what
        #: the leadership it won last (unique in the process): a new term means leadership
        #: was lost in between (its lease gone) and what was learnt while leading is stale
        self.term = 0
        #: called (from the lease's keep-alive thread) when etcd says the lease is gone
        self.on_lost = on_lost
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
            self.term = next(_TERMS)
            self._valid_until = time.monotonic() + self.ttl.total_seconds() * 0.8
            lease.keep_alive(
                interval=self.ttl.total_seconds() / 3,
                on_lost=self._lost,
                on_refreshed=self._refreshed,
            )
            log.warning("%s is now the leader%s", self.identity, self._of())
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
            log.warning("%s lost leadership%s: the leader lease expired", self.identity, self._of())
            self._lease = None
            if self.on_lost is not None:
                self.on_lost()

    def resign(self) -> None:
        """Stop leading: revoke the lease, so a standby takes over at once."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.revoke()

    def _of(self) -> str:
        return f" {self.what}" if self.what else ""


class JobLeadership:
    """A controller of every job campaigns for each job on the job's own election key.

    The key is the one a controller started for that job campaigns on
    (:func:`~orchestrator.state.keys.controller_leader`), so whatever mix of
    per-job controllers and controllers of every job runs, one process at a
    time decides a job.  A job led by another is tried again at most every
    ``retry_every`` (one failed create of a key), not at every tick; each job
    led has a lease of its own, so one that another controller should lead
    (it stops, it is resigned) is handed over without the others.

    Args:
        client: etcd.
        identity: the name written in each key won (default host-pid).
        ttl: each job's leader lease.
        retry_every: seconds between two tries for a job another controller leads
            (default a third of ``ttl``).
    """

    def __init__(
        self,
        client: EtcdClient,
        identity: str | None = None,
        ttl: timedelta = DEFAULT_LEADER_TTL,
        retry_every: float | None = None,
    ) -> None:
        self.client = client
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        self.ttl = ttl
        self.retry_every = ttl.total_seconds() / 3 if retry_every is None else retry_every
        self._elections: dict[str, LeaderElection] = {}
        self._next_try: dict[str, float] = {}
        # release_all may come from a lease's keep-alive thread (the controller's own
        # election lost), the rest from the controller's loop
        self._lock = threading.RLock()

    def term(self, job: str, worth_it: Callable[[], bool] | None = None) -> int | None:
        """The term of this process's leadership of ``job`` (None: it does not lead it now).

        Campaigns first when it does not lead the job, its next try is due and
        ``worth_it()`` (asked only then) says so: a job that has ended needs no leader.
        """
        with self._lock:
            election = self._elections.get(job)
            if election is None:
                key, what = keys.controller_leader(job), f"of job {job}"
                election = LeaderElection(self.client, self.identity, self.ttl, key, what)
                self._elections[job] = election
            if not election.is_leader:
                now = time.monotonic()
                if now < self._next_try.get(job, 0.0):
                    return None
                self._next_try[job] = now + self.retry_every
                if worth_it is not None and not worth_it():
                    return None
                if not election.try_acquire():
                    return None
            return election.term

    def leads(self, job: str) -> bool:
        """Whether this process leads ``job`` now (no campaign)."""
        with self._lock:
            election = self._elections.get(job)
            return election is not None and election.is_leader

    def release(self, job: str) -> None:
        """Stop leading ``job`` (it finished, or went) and stop campaigning for it."""
        with self._lock:
            election = self._elections.pop(job, None)
            self._next_try.pop(job, None)
            if election is not None:
                election.resign()

    def release_all(self) -> None:
        """Stop leading every job (this controller no longer runs jobs)."""
        with self._lock:
            for job in list(self._elections):
                self.release(job)

    def jobs(self) -> list[str]:
        """The jobs it campaigns for or leads."""
        with self._lock:
            return list(self._elections)
