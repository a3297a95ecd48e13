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

The same port answers requests (:func:`ask`): after the status line, a client
may send one JSON line ``{"op": ..., ...}`` and read one JSON line back.  The
agent serves its workers' output this way (``ringmaster logs``, see
:mod:`agents.node.log_files`).  A probe that just reads the status and closes is
answered as before, and a slow or silent client holds only its own thread.
An agent's port asks every request but the watch for the job's credential
(a *guard*, :class:`~orchestrator.state.port_credential.PortGuard`): the status and
the watch say only alive or dead; the rest is for whoever may read the job's
keys in etcd.  A request refused is answered with one error line, nothing else.

A probe is asked only once something already broke.  A **watch**
(``{"op": "watch"}``, :data:`WATCH_OP`) asks nothing more: the server answers
``{"watching": true}`` and keeps the connection open for as long as it runs.
When the server closes, it first sends ``{"bye": true}``; when the agent's
process dies, its kernel closes the connection with no such line.  So the
controller (:mod:`orchestrator.controller.node_watch`) learns of a killed
agent when it dies, not when a peer's next collective fails.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from orchestrator.ports.api import AgentUnreachableError, RequestError
from orchestrator.state.port_credential import TOKEN_FIELD

log = logging.getLogger("ringmaster.liveness")

#: Longest request line a server reads (bytes).
MAX_REQUEST = 64 * 1024
#: Longest answer a client reads (bytes).
MAX_ANSWER = 16 * 1024 * 1024
#: Seconds a server waits for a client's request line after the status.
REQUEST_WAIT = 5.0
#: Requests a server answers at once; a connection beyond gets the status only.
MAX_SESSIONS = 8
#: Seconds a server reads (and drops) what a refused streaming client still sends, so
#: that its refusal line is not lost to a reset; the connection is closed after them.
REFUSED_DRAIN_S = 1.0
#: The request that keeps a connection open until the server closes (see above).
WATCH_OP = "watch"
#: What a watch is answered at once, and what the server sends it when it closes.
WATCHING = b'{"watching": true}\n'
BYE = b'{"bye": true}\n'
#: A request's handler: the request (a JSON object) in, the answer (a JSON object) out.
Handler = Callable[[dict[str, Any]], dict[str, Any]]
#: A streamed request's handler: it also reads what the client sends after the
#: request line from the connection (:mod:`orchestrator.ports.link_probe`'s sink).
StreamHandler = Callable[[dict[str, Any], socket.socket], dict[str, Any]]
#: What a port asks of a request before it answers: ``(op, request)`` in, the
#: refusal's text out, or None to answer it
#: (:class:`~orchestrator.state.port_credential.PortGuard`).
Guard = Callable[[str, dict[str, Any]], str | None]


class Liveness(str, enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


class LivenessServer:
    """Accepts connections on ``address`` and answers each with ``status()`` as JSON.

    Args:
        address: the host to listen on (the port is chosen: see ``.address``).
        status: the status line every connection gets first.
        requests: ``op`` → handler, for the requests answered after the status.
        streams: ``op`` → handler of a request followed by a stream of bytes.
        guard: asked about every request but the watch before it is answered (a
            node agent's: the job's credential); None answers every request.
    """

    def __init__(
        self,
        address: str,
        status: Callable[[], dict[str, Any]],
        requests: Mapping[str, Handler] | None = None,
        streams: Mapping[str, StreamHandler] | None = None,
        guard: Guard | None = None,
    ) -> None:
        self._status = status
        self._guard = guard
        self._requests = dict(requests or {})
        self._streams = dict(streams or {})
        self._sessions = threading.BoundedSemaphore(MAX_SESSIONS)
        #: open watches (connections the server keeps until it closes)
        self._watches: list[socket.socket] = []
        self._watch_lock = threading.Lock()
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
            try:
                conn.sendall(json.dumps(self._status()).encode() + b"\n")
            except Exception:
                conn.close()
                continue
            if self._sessions.acquire(blocking=False):
                threading.Thread(
                    target=self._session, args=(conn,), name="liveness-request", daemon=True
                ).start()
            else:
                conn.close()

    def _session(self, conn: socket.socket) -> None:
        """Answer the one request a client may send after the status line."""
        try:
            with contextlib.ExitStack() as held, contextlib.suppress(OSError, RequestError):
                held.callback(conn.close)
                conn.settimeout(REQUEST_WAIT)
                line = read_line(conn, MAX_REQUEST)
                if not line:
                    return  # a probe: it read the status and closed
                if _op(line) == WATCH_OP:
                    self._watch(conn)
                    held.pop_all()  # kept open until this server closes
                    return
                if not (self._requests or self._streams):
                    return  # a port that serves watches only: closed, as before requests
                answer, answered = self._answer(line, conn)
                conn.sendall(json.dumps(answer, ensure_ascii=False).encode() + b"\n")
                if self._is_stream(line):  # let the client read the answer before it stops
                    _drain(conn, None if answered else REFUSED_DRAIN_S)
        finally:
            self._sessions.release()

    def _answer(self, line: bytes, conn: socket.socket) -> tuple[dict[str, Any], bool]:
        """The answer to a request line, and whether it was let through the guard."""
        try:
            request = json.loads(line)
        except ValueError:
            return {"error": "the request is not one line of JSON"}, False
        op = request.get("op") if isinstance(request, dict) else None
        if not isinstance(request, dict) or not isinstance(op, str):
            return {"error": 'a request is one JSON object with an "op"'}, False
        if self._guard is not None:
            refused = self._guard(op, request)
            if refused is not None:
                return {"error": refused}, False
        return self._handle(op, request, conn), True

    def _handle(self, op: str, request: dict[str, Any], conn: socket.socket) -> dict[str, Any]:
        stream = self._streams.get(op)
        handler = self._requests.get(op)
        if handler is None and stream is None:
            known = sorted([*self._requests, *self._streams])
            return {"error": f"unknown request {op!r}: this port answers {known}"}
        try:
            if stream is not None:
                return stream(request, conn)
            assert handler is not None
            return handler(request)
        except RequestError as e:
            return {"error": str(e)}
        except Exception as e:  # the answer says so; the port stays up
            log.warning("request %s failed: %s", op, e, exc_info=True)
            return {"error": f"{op} failed on the agent: {type(e).__name__}: {e}"}

    def _is_stream(self, line: bytes) -> bool:
        return _op(line) in self._streams

    def _watch(self, conn: socket.socket) -> None:
        """Keep ``conn`` open until this server closes (watches whose client left are
        dropped here, so a controller that comes and goes leaves no connections)."""
        conn.sendall(WATCHING)
        with self._watch_lock:
            for left in [w for w in self._watches if _hung_up(w)]:
                left.close()
                self._watches.remove(left)
            if self._closed.is_set():
                conn.sendall(BYE)
                conn.close()
            else:
                self._watches.append(conn)

    def close(self) -> None:
        """Stop accepting; each watch is told the close is a planned one, then closed."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._watch_lock:
            watches, self._watches = self._watches, []
        for conn in watches:
            with contextlib.suppress(OSError):
                conn.settimeout(0.2)
                conn.sendall(BYE)
            conn.close()
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


def _op(line: bytes) -> object:
    """The ``op`` of a request line, None if it is not a JSON object."""
    with contextlib.suppress(ValueError, AttributeError):
        return json.loads(line).get("op")
    return None


def _hung_up(conn: socket.socket) -> bool:
    """Whether the client of a watch closed its end (a read would find EOF or an error)."""
    try:
        conn.setblocking(False)
        try:
            return conn.recv(1, socket.MSG_PEEK) == b""
        finally:
            conn.setblocking(True)
    except BlockingIOError:
        return False
    except OSError:
        return True


def _drain(conn: socket.socket, within: float | None = None) -> None:
    """Read and drop what a streaming client still sends, until it closes or resets (a
    close with unread bytes would reset the connection and could drop the answer), or
    for ``within`` seconds at most (a refused client: it gets no more of the port)."""
    deadline = None if within is None else time.monotonic() + within
    with contextlib.suppress(OSError):
        conn.settimeout(REQUEST_WAIT)
        while True:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                conn.settimeout(left)
            if not conn.recv(65536):
                return


def read_line(conn: socket.socket, limit: int) -> bytes:
    """Bytes up to a newline (excluded); what came before EOF; ``RequestError`` past ``limit``."""
    data = bytearray()
    while True:
        end = data.find(b"\n")
        if end >= 0:
            return bytes(data[:end])
        if len(data) > limit:
            raise RequestError(f"a line over {limit} bytes")
        chunk = conn.recv(65536)
        if not chunk:
            return bytes(data)
        data += chunk


def ask(
    address: str, request: dict[str, Any], timeout: float = 5.0, token: str | None = None
) -> dict[str, Any]:
    """Send ``request`` to the port at ``host:port`` and return its answer.

    ``token``: the job's port credential (:mod:`orchestrator.state.port_credential`),
    sent with the request; an agent's port refuses every request but the
    watch without it.

    Raises:
        AgentUnreachableError: nothing answers there, the answer is cut short
            or over :data:`MAX_ANSWER`, or the agent answers no requests (an
            agent older than this port's requests).
        RequestError: the agent answered with an error (the message is its own).
    """
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as conn:
            conn.settimeout(timeout)
            if not read_line(conn, MAX_REQUEST):
                raise AgentUnreachableError(f"the agent at {address} closed without a status")
            try:
                sent = request if token is None else {**request, TOKEN_FIELD: token}
                conn.sendall(json.dumps(sent).encode() + b"\n")
                data = read_line(conn, MAX_ANSWER)
            except (ConnectionResetError, BrokenPipeError):
                # it closed after its status (a port without requests) before the
                # request got there: the kernel answers the request with a reset
                data = b""
    except RequestError as e:
        raise AgentUnreachableError(f"the agent at {address} answered {e}") from e
    except (OSError, ValueError) as e:
        raise AgentUnreachableError(f"the agent at {address} did not answer: {e}") from e
    if not data:
        raise AgentUnreachableError(
            f"the agent at {address} answers no requests (a ringmaster older than this one?)"
        )
    try:
        answer = json.loads(data)
    except ValueError as e:
        raise AgentUnreachableError(f"the agent at {address} answered something not JSON") from e
    if not isinstance(answer, dict):
        raise AgentUnreachableError(f"the agent at {address} answered {type(answer).__name__}")
    if "error" in answer:
        raise RequestError(f"the agent at {address}: {answer['error']}")
    return answer
