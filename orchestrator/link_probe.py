"""Measuring the links between nodes: how many bytes a second one agent gets to another.

A slow link (a degraded NIC, a congested switch port) slows every rank of a
synchronous job alike: each waits in the all-reduce for the one whose bytes
crawl, and no rank's own timings say which it is.  The controller then asks
the nodes' agents to measure (:mod:`orchestrator.controller.slow_links` decides
when, and what the figures say):

* each agent's port (:mod:`orchestrator.liveness`) has a **sink**
  (:data:`SINK_OP`): after the request line the client streams bytes for a
  while, closes its side, and the sink answers how many it received;
* an agent asked to **probe** (:data:`PROBE_OP`, with the peers' ports) streams
  to each peer in turn for ``seconds`` (at most ``max_bytes``) and answers
  each one's rate in bytes a second, the best of ``rounds`` tries (a try
  slowed by the host's scheduler says nothing of the link; one faster than the
  link is impossible).

The sink times what it receives (from its first bytes to ``seconds`` later)
and answers while the client still sends; the client then resets the
connection, so what is still queued for a slow link is dropped, not waited
for: a try takes about ``seconds`` on any link.  The
probes run on the agents' own connections, which take the same network path
as their workers' collectives (the node's address).
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import time
from typing import Any

from orchestrator.liveness import AgentUnreachableError, RequestError, read_line

__all__ = [
    "MAX_PROBE_BYTES",
    "PROBE_OP",
    "SINK_OP",
    "probe_peers",
    "send_probe",
    "sink",
]

#: The request a sink answers after reading a client's stream.
SINK_OP = "link-sink"
#: The request an agent answers by probing its peers.
PROBE_OP = "probe-links"
#: Most bytes one probe sends (and a sink reads).
MAX_PROBE_BYTES = 256 * 1024 * 1024
#: Send buffer of a probing connection: small, so little is left in flight at the end.
SEND_BUFFER = 64 * 1024
#: Seconds a sink waits for the next bytes before it gives up on a client.
SINK_IDLE_S = 10.0
_CHUNK = bytes(64 * 1024)


def sink(request: dict[str, Any], conn: socket.socket) -> dict[str, Any]:
    """Read a client's stream for ``seconds`` from its first bytes (or to its end); answer
    the bytes that came after the first read and the time they took.  The time is the
    whole window, not the last packet's: on a slow link a window holds few packets."""
    window = min(max(float(request.get("seconds", 0.2)), 0.01), 30.0)
    buf = bytearray(256 * 1024)
    received, first, end = 0, 0.0, 0.0
    while True:
        left = first + window - time.perf_counter() if first else SINK_IDLE_S
        if left <= 0:
            end = first + window
            break
        conn.settimeout(min(left, SINK_IDLE_S))
        try:
            n = conn.recv_into(buf)
        except TimeoutError:
            if not first:
                raise
            continue  # the window ends at the top of the loop
        now = time.perf_counter()
        if n == 0:
            end = now
            break
        if not first:
            first = now  # the clock starts at the first bytes: they are not counted
            continue
        received += n
        if received > MAX_PROBE_BYTES:
            end = now
            break
    return {"received": received, "seconds": max(end - first, 0.0) if first else 0.0}


def send_probe(address: str, seconds: float, max_bytes: int, timeout: float = 30.0) -> float:
    """Stream to the sink at ``host:port`` until it answers (after ``seconds`` of bytes)
    or ``max_bytes`` are sent.

    The connection is reset once the answer is in, so what is still queued for a
    slow link is dropped rather than waited for.

    Returns:
        Bytes a second that reached the sink, as the sink timed them.

    Raises:
        AgentUnreachableError: the peer's port did not answer, or not as a sink.
    """
    host, _, port = address.rpartition(":")
    request = json.dumps({"op": SINK_OP, "seconds": seconds}).encode() + b"\n"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            conn.settimeout(timeout)
            if not read_line(conn, 64 * 1024):
                raise AgentUnreachableError(f"the agent at {address} closed without a status")
            conn.sendall(request)
            line = _stream_until_answered(conn, min(max_bytes, MAX_PROBE_BYTES), timeout)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except RequestError as e:
        raise AgentUnreachableError(f"the agent at {address} answered {e}") from e
    except (BrokenPipeError, ConnectionResetError) as e:
        raise AgentUnreachableError(
            f"the agent at {address} stopped reading the probe ({e}): it has no link sink "
            "(a ringmaster older than this one?) or it went away"
        ) from e
    except (OSError, ValueError) as e:
        raise AgentUnreachableError(f"probing the link to {address}: {e}") from e
    try:
        answer = json.loads(line)
        received, took = int(answer["received"]), float(answer["seconds"])
    except (ValueError, KeyError, TypeError) as e:
        raise AgentUnreachableError(
            f"the agent at {address} has no link sink (a ringmaster older than this one?): "
            f"it answered {line[:200]!r}"
        ) from e
    return received / took if took > 0 else 0.0


def _stream_until_answered(conn: socket.socket, limit: int, timeout: float) -> bytes:
    """Send zeros until the peer's answer line can be read (or ``limit`` bytes went)."""
    conn.setblocking(False)
    sent, data, deadline = 0, bytearray(), time.monotonic() + timeout
    writing = True
    while time.monotonic() < deadline:
        readable, writable, _ = select.select([conn], [conn] if writing else [], [], 0.5)
        if readable:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
            if b"\n" in data:
                return bytes(data[: data.index(b"\n")])
        if writable and writing:
            with contextlib.suppress(BlockingIOError):
                sent += conn.send(_CHUNK[: min(len(_CHUNK), limit - sent)])
            if sent >= limit:
                conn.shutdown(socket.SHUT_WR)  # the sink answers at the end of the stream
                writing = False
    raise TimeoutError(f"no answer within {timeout:g}s")


def probe_peers(request: dict[str, Any]) -> dict[str, Any]:
    """An agent's answer to :data:`PROBE_OP`: its rate to each peer (see the docstring).

    The request: ``peers`` (node → ``host:port``), ``seconds`` and ``max_bytes``
    per try, ``rounds`` tries per peer.  A peer that cannot be reached is
    answered with its error, not a rate.
    """
    peers = request.get("peers")
    if not isinstance(peers, dict):
        raise RequestError("probe-links needs 'peers': node -> host:port")
    seconds = float(request.get("seconds", 0.2))
    max_bytes = int(request.get("max_bytes", 16 * 1024 * 1024))
    rounds = max(1, int(request.get("rounds", 2)))
    rates: dict[str, float] = {}
    errors: dict[str, str] = {}
    for node, address in sorted(peers.items()):
        try:
            rates[node] = max(send_probe(str(address), seconds, max_bytes)
                              for _ in range(rounds))  # fmt: skip
        except AgentUnreachableError as e:
            errors[node] = str(e)
    return {"rates": rates, "errors": errors}
