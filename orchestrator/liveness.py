"""A node's liveness port: the controller's fast answer to "is that node dead?".

When a collective fails, the survivors report within milliseconds, but a
node that was killed outright reports nothing.  Rather than wait out a grace
period (or the registration lease) to tell "dead" from "slow to report", the
controller connects to the agent's liveness port:

* the connection is **refused** or reset: nothing listens there any more,
  the agent is gone — the node is dead now;
* the agent **answers** (one JSON line with its workers' state): the node is
  alive, so its report is worth waiting for;
* no answer within the timeout (host down, link cut): **unknown**, and the
  controller falls back to the grace period and the lease.

The agent's answer lists which local workers are running, so a node whose
agent lives but whose workers all exited is told apart too.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ringmaster.liveness")


class Liveness(str, enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


class LivenessServer:
    """Accepts connections on ``address`` and answers each with ``status()`` as JSON."""

    def __init__(self, address: str, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status
        self._sock = socket.create_server((address, 0), backlog=16)
        self._sock.settimeout(0.5)
        self.address = f"{address}:{self._sock.getsockname()[1]}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn, contextlib.suppress(Exception):
                conn.sendall(json.dumps(self._status()).encode() + b"\n")

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=2)

    def __enter__(self) -> LivenessServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe(address: str, timeout: float = 0.25) -> tuple[Liveness, dict[str, Any]]:
    """Ask the liveness port at ``host:port``; returns the verdict and the agent's answer."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as conn:
            conn.settimeout(timeout)
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
    except (ConnectionRefusedError, ConnectionResetError):
        return Liveness.DEAD, {}
    except (TimeoutError, OSError, ValueError) as e:
        log.debug("liveness probe of %s: %s", address, e)
        return Liveness.UNKNOWN, {}
    if not data:
        return Liveness.UNKNOWN, {}  # accepted, then closed without an answer
    try:
        answer = json.loads(data)
    except ValueError:
        return Liveness.UNKNOWN, {}
    return Liveness.ALIVE, answer if isinstance(answer, dict) else {}
