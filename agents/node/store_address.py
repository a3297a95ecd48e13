"""Where a generation's c10d store listens: published by rank 0's agent, read by the others.

Runs in the node agent (the restart tier, :mod:`agents.node.restart_tier`).
Rank 0's worker hosts the generation's TCPStore (torchrun's ``env://``), on a
port its agent picked.  That agent publishes ``host:port`` under the
generation's key (``/ringmaster/jobs/<job>/pg/<gen>/master``) once the port
listens (:class:`PendingStore`), or after :data:`PUBLISH_FALLBACK` when it
does not (a script may do much work before ``init_process_group``); every
other node's agent waits for that key (:class:`AwaitedStore`) before it
launches its workers.  A store client that comes before its server retries
after a random backoff of up to half a second, so waiting for the port is
faster than racing it.

Both are states that the tier's supervision loop looks at, never blocking
waits: the loop also follows newer generations, the end of the run and a stop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys
from orchestrator.state.records import Member, Plan

__all__ = ["AwaitedStore", "PendingStore", "listening", "store_key"]

log = logging.getLogger("ringmaster.agent")

#: How often a waiting agent looks for the generation's store address.
MASTER_POLL = 0.02
#: Seconds rank 0's agent waits for the store port to listen before it publishes
#: the address anyway.
PUBLISH_FALLBACK = 2.0


def store_key(job: str, generation: int) -> str:
    """The key under which the generation's store address is published."""
    return keys.pg_store(job, generation) + "master"


def listening(port: int) -> bool:
    """Whether a local TCP socket listens on ``port`` (``/proc/net/tcp*``; no connection
    is made).  True where that cannot be read (not Linux): then nobody waits for it."""
    seen = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for row in rows:
            fields = row.split()  # sl, local address:port (hex), remote, state (0A: LISTEN)
            local_port = int(fields[1].rsplit(":", 1)[1], 16) if len(fields) > 3 else -1
            if local_port == port and fields[3] == "0A":
                return True
    return not seen


@dataclass
class PendingStore:
    """Rank 0 is launched; its store address is published once the port listens."""

    plan: Plan
    member: Member
    key: str
    master: tuple[str, int]
    deadline: float

    @classmethod
    def after_launch(
        cls, job: str, plan: Plan, member: Member, master: tuple[str, int]
    ) -> PendingStore:
        """Rank 0 was just launched with its store at ``master``."""
        deadline = time.monotonic() + PUBLISH_FALLBACK
        return cls(plan, member, store_key(job, plan.generation), master, deadline)

    def publish(self, client: EtcdClient, node: str) -> bool:
        """Publish the address if the port listens (or the fallback time passed).

        Returns:
            True once published (the other local ranks may start).
        """
        port = self.master[1]
        if not listening(port) and time.monotonic() < self.deadline:
            return False
        try:
            client.put(self.key, f"{self.master[0]}:{port}")
        except EtcdError as e:
            log.warning("[%s] publishing the store address (will retry): %s", node, e)
            return False
        return True


@dataclass
class AwaitedStore:
    """This node waits for the address rank 0's agent publishes, then launches."""

    plan: Plan
    member: Member
    key: str
    next_read: float = 0.0

    @classmethod
    def for_plan(cls, job: str, plan: Plan, member: Member) -> AwaitedStore:
        return cls(plan, member, store_key(job, plan.generation))

    def read(self, client: EtcdClient, node: str) -> tuple[str, int] | None:
        """``(host, port)`` once published; None before (read every :data:`MASTER_POLL`)."""
        if time.monotonic() < self.next_read:
            return None
        self.next_read = time.monotonic() + MASTER_POLL
        try:
            kv = client.get(self.key)
        except EtcdError as e:
            log.debug("[%s] waiting for %s: %s", node, self.key, e)
            return None
        if kv is None:
            return None
        host, _, number = kv.value.decode().rpartition(":")
        return host, int(number)
