"""A connection held open to every node's agent: its close is the agent's death.

The liveness probes of :mod:`orchestrator.controller.world` are asked only
once a survivor reports a broken collective, and a survivor in the middle of
a long step reports only when its next collective fails: at a gigabyte of
state that is a second or more after the kill.  A killed agent's kernel closes
its connections at once, though.  So the controller keeps one *watch*
connection to each registered node's liveness port (the ``watch`` request of
:mod:`orchestrator.ports.liveness`):

* the agent closes it with ``{"bye": true}`` first: a planned close (the
  agent left; its registration goes with it), not a death;
* it closes without that line, or resets: the agent's process is gone, and
  the node is **gone** (:meth:`NodeWatch.gone`) from that moment;
* nothing happens while a link is cut or a host is frozen: those are left to
  the probes, the heartbeats and the lease, as before.

One thread waits on every connection at once (a selector); connections are
made by a small pool beside it, so a node that does not answer delays no
other node's news.  A connection that cannot be made is tried again later;
an agent that answers the watch with an error (one older than it) is not
watched.  Runs in the controller; the policy reads only :meth:`NodeWatch.gone`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from orchestrator.ports.liveness import BYE, MAX_ANSWER, MAX_REQUEST, WATCH_OP, WATCHING, read_line

__all__ = ["CONNECT_THREADS", "HANDSHAKE_TIMEOUT", "NodeWatch"]

log = logging.getLogger("ringmaster.controller")

#: Connections being made at once.
CONNECT_THREADS = 16
#: Seconds to connect, read the status and get the watch answered.
HANDSHAKE_TIMEOUT = 2.0
#: Seconds before a failed connection is tried again (doubling up to the last).
RETRY_S = (1.0, 30.0)


class NodeWatch:
    """Watches the agents at the addresses :meth:`follow` was last given.

    Args:
        on_gone: called (on the watch's thread) when an agent is found gone:
            the controller's loop wakes on it.
    """

    def __init__(self, on_gone: Callable[[], None] | None = None) -> None:
        self._on_gone = on_gone
        self._lock = threading.Lock()
        #: node -> the address to watch (what the controller last saw registered)
        self._want: dict[str, str] = {}
        #: node -> (the address whose watch closed unannounced, when: wall clock)
        self._gone: dict[str, tuple[str, float]] = {}
        #: address -> (monotonic time before which it is not tried again, next wait)
        self._retry: dict[str, tuple[float, float]] = {}
        #: addresses not watched again: their agent left, or answers no watch
        self._done: set[str] = set()
        #: node -> (address, connection) of the open watches; the loop's thread only
        self._open: dict[str, tuple[str, socket.socket]] = {}
        #: node -> what its open watch received (a bye may come in pieces)
        self._heard: dict[str, bytes] = {}
        #: node -> (address, the attempt to connect to it)
        self._pending: dict[str, tuple[str, Future[socket.socket]]] = {}
        #: nodes with an open watch, as the loop last saw them
        self._watching: frozenset[str] = frozenset()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        # made by the first follow() with an agent to watch (a controller of agents
        # that have no liveness port holds nothing)
        self._selector = selectors.DefaultSelector()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._pool: ThreadPoolExecutor | None = None

    def follow(self, addresses: Mapping[str, str]) -> None:
        """Watch these nodes' agents (node -> liveness address) and no others."""
        with self._lock:
            if dict(addresses) == self._want or self._closed.is_set():
                return
            self._want = dict(addresses)
            if self._thread is None:
                self._wake_r, self._wake_w = socket.socketpair()
                self._wake_r.setblocking(False)
                self._selector.register(self._wake_r, selectors.EVENT_READ)
                self._pool = ThreadPoolExecutor(CONNECT_THREADS, "node-watch-connect")
                self._thread = threading.Thread(target=self._loop, name="node-watch", daemon=True)
                self._thread.start()
        self._poke()

    def gone(self) -> dict[str, float]:
        """Nodes whose agent's watch closed unannounced (at the address it is followed
        at), with when that was seen (wall clock)."""
        with self._lock:
            return {n: t for n, (a, t) in self._gone.items() if self._want.get(n) == a}

    def watching(self) -> set[str]:
        """Nodes with an open watch now."""
        with self._lock:
            return set(self._watching)

    def close(self) -> None:
        with self._lock:
            self._closed.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for _, future in self._pending.values():  # those still running close on landing
            # (one that shutdown cancelled before it ran opened nothing, and would raise)
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().close()
        for _, conn in self._open.values():
            conn.close()
        self._open.clear()
        self._selector.close()
        for end in (self._wake_r, self._wake_w):
            if end is not None:
                end.close()

    def __enter__(self) -> NodeWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop's thread -------------------------------------------------------------

    def _poke(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._round()
            except Exception:  # the watch must outlive a surprise; the probes remain
                log.warning("the agents' watch failed a round; going on", exc_info=True)
                self._closed.wait(1.0)

    def _round(self) -> None:
        """One round: follow the registrations, take and start connections, wait."""
        with self._lock:
            want = dict(self._want)
        self._drop_unwanted(want)
        self._take_connections(want)
        self._start_connections(want)
        with self._lock:
            self._watching = frozenset(self._open)
        for key, _ in self._selector.select(timeout=self._next_retry(want)):
            if key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                self._read(key.data)

    def _drop_unwanted(self, want: dict[str, str]) -> None:
        for node, (address, _) in list(self._open.items()):
            if want.get(node) != address:
                self._forget(node)
        with self._lock:  # nodes gone from the registrations are forgotten
            self._gone = {n: g for n, g in self._gone.items() if want.get(n) == g[0]}
        self._done &= set(want.values())

    def _unwatched(self, want: dict[str, str]) -> dict[str, str]:
        """The nodes of ``want`` to connect to (now, or when their retry is due)."""
        return {
            node: address
            for node, address in want.items()
            if node not in self._open
            and node not in self._pending
            and address not in self._done
            and self._gone.get(node, ("", 0.0))[0] != address
        }

    def _start_connections(self, want: dict[str, str]) -> None:
        now = time.monotonic()
        for node, address in self._unwatched(want).items():
            if self._retry.get(address, (0.0, 0.0))[0] > now:
                continue
            assert self._pool is not None
            future = self._pool.submit(_connect, address)
            future.add_done_callback(self._landed)
            self._pending[node] = (address, future)

    def _landed(self, future: Future[socket.socket]) -> None:
        """A connection attempt ended: the loop takes it, or it is closed after close()."""
        if not self._closed.is_set():
            self._poke()
        elif not future.cancelled() and future.exception() is None:
            future.result().close()

    def _take_connections(self, want: dict[str, str]) -> None:
        for node, (address, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[node]
            try:
                conn = future.result()
            except _Unwatchable as e:
                log.info("not watching %s's agent at %s: %s", node, address, e)
                self._done.add(address)
                continue
            except Exception:  # _NotNow, or the pool shut down
                first, longest = RETRY_S
                wait = min(self._retry.get(address, (0.0, first / 2))[1] * 2, longest)
                self._retry[address] = (time.monotonic() + wait, wait)
                continue
            if want.get(node) != address:
                conn.close()  # registered again elsewhere meanwhile
                continue
            self._retry.pop(address, None)
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ, node)
            self._open[node] = (address, conn)

    def _next_retry(self, want: dict[str, str]) -> float | None:
        """Seconds until a connection waiting to be tried again is due (None: none waits)."""
        wanted = set(want.values())
        self._retry = {a: r for a, r in self._retry.items() if a in wanted}
        waiting = set(self._unwatched(want).values())
        due = [at for a, (at, _) in self._retry.items() if a in waiting]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _read(self, node: str) -> None:
        address, conn = self._open[node]
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:  # reset: the peer's kernel answered for a process that is gone
            data = b""
        heard = self._heard[node] = (self._heard.get(node, b"") + data)[:64]
        planned = BYE.strip() in heard
        if data and not planned:
            return  # nothing else is sent on a watch
        self._forget(node)
        if planned:  # the agent closed it on purpose: its registration goes with it
            self._done.add(address)
            return
        log.info("the agent of %s (%s) is gone: its watch closed unannounced", node, address)
        with self._lock:
            self._gone[node] = (address, time.time())
        if self._on_gone is not None:
            self._on_gone()

    def _forget(self, node: str) -> None:
        _, conn = self._open.pop(node)
        self._heard.pop(node, None)
        self._selector.unregister(conn)
        conn.close()


class _NotNow(Exception):
    """The watch could not be made now (nothing listens yet, a timeout): try later."""


class _Unwatchable(_NotNow):
    """The agent answers no watch (older than this controller): do not ask again."""


def _connect(address: str) -> socket.socket:
    """A watch on the agent at ``address``, answered (raises ``_NotNow`` / ``_Unwatchable``)."""
    host, _, port = address.rpartition(":")
    try:
        conn = socket.create_connection((host, int(port)), timeout=HANDSHAKE_TIMEOUT)
    except (OSError, ValueError) as e:
        raise _NotNow(str(e)) from e
    try:
        conn.settimeout(HANDSHAKE_TIMEOUT)
        if not read_line(conn, MAX_ANSWER):  # the status, as a probe reads it
            raise _NotNow("closed before its status")
        conn.sendall(json.dumps({"op": WATCH_OP}).encode() + b"\n")
        answer = read_line(conn, MAX_REQUEST)
    except _NotNow:
        conn.close()
        raise
    except Exception as e:
        conn.close()
        raise _NotNow(str(e)) from e
    if answer + b"\n" == WATCHING:
        return conn
    conn.close()
    if not answer:  # closed after the status: its requests were all taken
        raise _NotNow("closed after its status")
    raise _Unwatchable(f"answered {answer[:200]!r}")
