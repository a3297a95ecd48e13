"""Where a generation's bootstrap store is: the address its rank 0 published, once it answers.

Runs in a worker (:func:`agents.runtime.process_group.form_group`).  Rank 0
hosts the generation's ``TCPStore`` and publishes ``host:port`` in etcd; the
other ranks read it here.  An address can outlive its store: workers
restarted by their agent re-form their generation, and a peer may read the
address of the rank 0 that died before the new one publishes its own.
torch's client would retry that port for its whole timeout (30 s, twice), so
an address is used only once a TCP connection to it is accepted.
"""

from __future__ import annotations

import logging
import socket
import time

from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient

__all__ = ["PROBE_TIMEOUT_S", "answers", "wait_for_store"]

log = logging.getLogger(__name__)

#: How often a rank reads the key while nothing is published, and while the
#: published store refuses connections.
MASTER_POLL_S = 0.01
STALE_POLL_S = 0.05
#: How long a connection to a published store may take before it counts as
#: refused (its host gone).
PROBE_TIMEOUT_S = 2.0


def wait_for_store(client: EtcdClient, key: str, deadline: float) -> tuple[str, int]:
    """``(host, port)`` published at ``key``, once a connection to it is accepted.

    Raises:
        RuntimeError: no address, or none that answered, before ``deadline``
            (``time.monotonic()``).
    """
    stale: tuple[str, int] | None = None
    while True:
        try:
            kv = client.get(key)
        except EtcdError as e:  # etcd away for a moment: keep waiting until the deadline
            log.debug("waiting for %s: %s", key, e)
            kv = None
        if kv is not None:
            host, _, port = kv.value.decode().rpartition(":")
            address = (host, int(port))
            if answers(address, deadline):
                return address
            if stale is None:
                log.info(
                    "the store at %s:%s refuses connections; waiting for rank 0 to publish another",
                    host,
                    port,
                )
            stale = address
        if time.monotonic() >= deadline:
            what = f"a store that answers (last: {stale[0]}:{stale[1]})" if stale else "it"
            raise RuntimeError(
                f"rank 0 did not publish the store address at {key} in time ({what})"
            )
        time.sleep(MASTER_POLL_S if stale is None else STALE_POLL_S)


def answers(address: tuple[str, int], deadline: float) -> bool:
    """Whether a TCP connection to ``address`` is accepted (it is closed at once)."""
    wait = min(PROBE_TIMEOUT_S, max(deadline - time.monotonic(), 0.05))
    try:
        socket.create_connection(address, timeout=wait).close()
    except OSError:
        return False
    return True
