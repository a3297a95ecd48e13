"""Measuring the links between nodes: how many bytes a second one agent gets to another.

A slow link (a degraded NIC, a congested switch port) slows every rank of a
synchronous job alike: each waits in the all-reduce for the one whose bytes
crawl, and no rank's own timings say which it is.  The controller then asks
the nodes' agents to measure (:mod:`orchestrator.controller.slow_links` decides
when, and what the figures say):

* each agent's port (:mod:`orchestrator.ports.liveness`) has a **sink**
  (:data:`SINK_OP`): after the request line the client streams bytes for a
  while, closes its side, and the sink answers how many it received;
* an agent asked to **probe** (:data:`PROBE_OP`, with the peers' ports) streams
  to each peer in turn for ``seconds`` (at most ``max_bytes``) and answers
  each one's rate in bytes a second, the best of ``rounds`` tries (a try
  slowed by the host's scheduler says nothing of the link; one faster than the
  link is impossible).

Both are asked with the job's port credential (:mod:`orchestrator.state.port_credential`),
and both are bounded: a try streams at most :data:`MAX_PROBE_SECONDS` and
:data:`MAX_PROBE_BYTES`, a probe makes at most :data:`MAX_PROBE_ROUNDS` tries to
each of at most :data:`MAX_PROBE_PEERS` peers, and a request beyond a bound is
refused, naming it.  An agent probes only nodes its job has registered, at the
addresses they registered (:func:`registered_ports`): a request naming another
node, or a registered node at another address, is refused whole.  So a probe
costs at most 4 x 4 x 32 MiB (16 s) of one agent's link, and only those who may
read the job's keys can ask for one.

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
from collections.abc import Callable, Mapping
from typing import Any

from orchestrator.etcd.client import EtcdClient
from orchestrator.ports.api import AgentUnreachableError, RequestError
from orchestrator.ports.liveness import read_line
from orchestrator.state import keys, records
from orchestrator.state.port_credential import TOKEN_FIELD

__all__ = [
    "MAX_PROBE_BYTES",
    "MAX_PROBE_PEERS",
    "MAX_PROBE_ROUNDS",
    "MAX_PROBE_SECONDS",
    "PROBE_OP",
    "SINK_OP",
    "probe_peers",
    "registered_ports",
    "send_probe",
    "sink",
]

#: The request a sink answers after reading a client's stream.
SINK_OP = "link-sink"
#: The request an agent answers by probing its peers.
PROBE_OP = "probe-links"
#: Most seconds one try streams (and a sink times); a request asking more is refused.
MAX_PROBE_SECONDS = 1.0
#: Most bytes one try sends (and a sink reads); a request asking more is refused.
MAX_PROBE_BYTES = 32 * 1024 * 1024
#: Most tries per peer in one probe request; a request asking more is refused.
MAX_PROBE_ROUNDS = 4
#: Most peers one probe request names (the controller names two); more are refused.
MAX_PROBE_PEERS = 4
#: What a probe request asks when it does not say (the controller's own figures).
DEFAULT_SECONDS = 0.2
DEFAULT_BYTES = 16 * 1024 * 1024
DEFAULT_ROUNDS = 2
#: Send buffer of a probing connection: small, so little is left in flight at the end.
SEND_BUFFER = 64 * 1024
#: Seconds a sink waits for the next bytes before it gives up on a client.
SINK_IDLE_S = 10.0
_CHUNK = bytes(64 * 1024)


def sink(request: dict[str, Any], conn: socket.socket) -> dict[str, Any]:
    """Read a client's stream for ``seconds`` from its first bytes (or to its end); answer
    the bytes that came after the first read and the time they took.  The time is the
    whole window, not the last packet's: on a slow link a window holds few packets."""
    window = max(_bounded(request, "seconds", DEFAULT_SECONDS, MAX_PROBE_SECONDS, SINK_OP), 0.01)
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


def send_probe(
    address: str, seconds: float, max_bytes: int, timeout: float = 30.0, token: str | None = None
) -> float:
    """Stream to the sink at ``host:port`` until it answers (after ``seconds`` of bytes)
    or ``max_bytes`` are sent (``token``: the job's port credential, which an agent's
    sink asks for).

    The connection is reset once the answer is in, so what is still queued for a
    slow link is dropped rather than waited for.

    Returns:
        Bytes a second that reached the sink, as the sink timed them.

    Raises:
        AgentUnreachableError: the peer's port did not answer, or not as a sink.
        RequestError: the sink refused the request (a credential missing or wrong, a
            bound exceeded); the message is its own.
    """
    host, _, port = address.rpartition(":")
    asked: dict[str, Any] = {"op": SINK_OP, "seconds": seconds}
    if token is not None:
        asked[TOKEN_FIELD] = token
    request = json.dumps(asked).encode() + b"\n"
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
        refused = answer.get("error") if isinstance(answer, dict) else None
        if isinstance(refused, str) and not refused.startswith("unknown request"):
            raise RequestError(f"the agent at {address}: {refused}")  # a sink refused it
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


def _bounded(request: dict[str, Any], name: str, default: float, bound: float, op: str) -> float:
    """``request[name]`` (``default`` when absent), refused unless it is above 0 and at
    most ``bound``."""
    value = request.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= bound:
        raise RequestError(
            f"{op}: {name} {value!r} is not allowed: ask for more than 0 and at most {bound:g} "
            f"(the bound of orchestrator.ports.link_probe)"
        )
    return float(value)


def registered_ports(client: EtcdClient, job: str) -> dict[str, str]:
    """node → its agent's port, for every node of ``job`` registered now (what an agent
    may probe).  A registration that cannot be read is left out."""
    out: dict[str, str] = {}
    for kv in client.get_prefix(keys.job_nodes(job)):
        try:
            record = records.decode(records.NodeRecord, kv.value, kv.key)
        except records.RecordError:
            continue
        if record.liveness:
            out[kv.key.rsplit("/", 1)[-1]] = record.liveness
    return out


def probe_peers(
    request: dict[str, Any],
    registered: Callable[[], Mapping[str, str]],
    token: str | None = None,
    job: str = "",
) -> dict[str, Any]:
    """An agent's answer to :data:`PROBE_OP`: its rate to each peer (see the docstring).

    The request: ``peers`` (node → ``host:port``, at most :data:`MAX_PROBE_PEERS`),
    ``seconds`` and ``max_bytes`` per try, ``rounds`` tries per peer, each within
    its bound.  Every peer must be a node of the job registered now at that very
    address (``registered()``); the probes carry ``token`` to the peers' sinks.
    A peer that cannot be reached is answered with its error, not a rate.

    Raises:
        RequestError: a bound is exceeded, or a peer is not a registered node of the
            job at that address (nothing is probed then).
    """
    peers = request.get("peers")
    if not isinstance(peers, dict) or not peers:
        raise RequestError(f"{PROBE_OP} needs 'peers': node -> host:port")
    if len(peers) > MAX_PROBE_PEERS:
        raise RequestError(
            f"{PROBE_OP}: {len(peers)} peers asked; at most {MAX_PROBE_PEERS} per request "
            "(orchestrator.ports.link_probe.MAX_PROBE_PEERS): split the probe"
        )
    seconds = _bounded(request, "seconds", DEFAULT_SECONDS, MAX_PROBE_SECONDS, PROBE_OP)
    max_bytes = int(_bounded(request, "max_bytes", DEFAULT_BYTES, MAX_PROBE_BYTES, PROBE_OP))
    rounds = request.get("rounds", DEFAULT_ROUNDS)
    if (
        isinstance(rounds, bool)
        or not isinstance(rounds, int)
        or not 1 <= rounds <= MAX_PROBE_ROUNDS
    ):
        raise RequestError(
            f"{PROBE_OP}: rounds {rounds!r} is not allowed: ask for 1 to {MAX_PROBE_ROUNDS} "
            "(orchestrator.ports.link_probe.MAX_PROBE_ROUNDS)"
        )
    known = registered()
    whose = f"job '{job}'" if job else "this agent's job"
    for node, address in sorted(peers.items()):
        if node not in known:
            have = ", ".join(sorted(known)) or "none"
            raise RequestError(
                f"{PROBE_OP}: {node!r} is not a registered node of {whose} (registered: "
                f"{have}); an agent probes only its job's nodes, at their registered ports"
            )
        if address != known[node]:
            raise RequestError(
                f"{PROBE_OP}: node {node!r} is registered at {known[node]}, not at "
                f"{address!r}; ask again with the address of its registration"
            )
    rates: dict[str, float] = {}
    errors: dict[str, str] = {}
    for node, address in sorted(peers.items()):
        try:
            rates[node] = max(
                send_probe(address, seconds, max_bytes, token=token) for _ in range(rounds)
            )
        except (AgentUnreachableError, RequestError) as e:
            errors[node] = str(e)
    return {"rates": rates, "errors": errors}
