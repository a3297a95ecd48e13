"""A node's workers learn the plan from their agent, not from etcd.

Every worker used to watch the plan and control keys itself: at 1,000 nodes x
8 workers a new plan (110 KB) went out of etcd 9,000 times, once to each
worker and once to each agent.  Now the agent, which watches both keys anyway,
passes what it sees to its workers over a local stream socket (named in
:data:`ENV_PLAN_FEED`), and etcd sends a plan once per node.

A :class:`PlanFeed` keeps the newest value of each key, by ``mod_revision``,
and sends it to every connected worker: at once when it changes, and on
connecting.  A worker reads the feed with :func:`follow_feed`
(:class:`agents.runtime.plan_watch.PlanWatcher` does); when the feed ends (the agent
gone, or the worker too slow to read and dropped) the worker watches etcd
itself, as it does without an agent.

A frame is ``kind`` (one byte: :data:`PLAN` or :data:`CONTROL`), the value's
``mod_revision`` (8 bytes) and its length (4 bytes), big-endian, then the
value as stored in etcd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import uuid
from collections.abc import Iterator

log = logging.getLogger("ringmaster.agent")

#: The environment variable that names the agent's plan feed (``@`` + an abstract
#: socket name); without it a worker watches the plan in etcd itself.
ENV_PLAN_FEED = "RINGMASTER_PLAN_FEED"
#: Frame kinds: the job's plan, and its control record.
PLAN, CONTROL = b"p", b"c"
#: How long a send to one worker may block before that worker is dropped (it
#: then watches etcd itself); a live worker reads its feed from its own thread.
SEND_TIMEOUT_S = 1.0
#: How long the accept waits before it looks at the stop flag (close() also wakes it).
ACCEPT_TIMEOUT_S: float | None = 0.5
#: Largest value a frame carries (etcd refuses a request over 1.5 MiB).
MAX_VALUE = 8 * 1024 * 1024

_HEADER = struct.Struct(">cQI")


def frame(kind: bytes, revision: int, value: bytes) -> bytes:
    """One frame of the feed."""
    return _HEADER.pack(kind, revision, len(value)) + value


class PlanFeed:
    """The agent's side: the newest plan and control values, sent to every worker.

    One daemon thread accepts workers; :meth:`publish` sends from the caller's
    thread (the agent's watch of the key).
    """

    def __init__(self) -> None:
        name = f"\0ringmaster-plan-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(name)
        self._server.listen(64)
        self._server.settimeout(ACCEPT_TIMEOUT_S)
        #: what a worker's environment names the feed by
        self.address = "@" + name[1:]
        self._lock = threading.Lock()
        self._latest: dict[bytes, tuple[int, bytes]] = {}
        self._workers: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="plan-feed", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> int:
        """Workers reading the feed now."""
        with self._lock:
            return len(self._workers)

    def publish(self, kind: bytes, value: bytes, revision: int) -> bool:
        """Send ``value`` (stored at ``revision``) to every worker; False when what
        the feed holds of ``kind`` is as new already (a watch event after a re-read)."""
        with self._lock:
            held = self._latest.get(kind)
            if held is not None and held[0] >= revision:
                return False
            self._latest[kind] = (revision, value)
            data = frame(kind, revision, value)
            for worker in list(self._workers):
                self._send(worker, data)
        return True

    def _send(self, worker: socket.socket, data: bytes) -> None:
        """Send to one worker (lock held); drop it when it does not take the frame."""
        try:
            worker.sendall(data)
        except OSError as e:  # gone, or not reading
            log.debug("plan feed: a worker dropped (%s)", e)
            self._workers.remove(worker)
            worker.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                worker, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if self._stop.is_set():  # close()'s wake-up
                worker.close()
                return
            worker.settimeout(SEND_TIMEOUT_S)
            with self._lock:
                self._workers.append(worker)
                for kind, (revision, value) in list(self._latest.items()):
                    self._send(worker, frame(kind, revision, value))

    def close(self) -> None:
        """Stop: every worker's feed ends (a worker still running watches etcd)."""
        self._stop.set()
        # a connection wakes the accept at once (not after its 0.5 s timeout)
        wake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(OSError), wake:
            wake.connect("\0" + self.address[1:])
        self._thread.join(timeout=2)
        self._server.close()
        with self._lock:
            for worker in self._workers:
                with contextlib.suppress(OSError):
                    worker.close()
            self._workers = []


class FeedError(OSError):
    """The feed sent something that is not a frame."""


def follow_feed(address: str, stopped: threading.Event) -> Iterator[tuple[bytes, int, bytes]]:
    """The frames of the agent's feed at ``address``, as ``(kind, revision, value)``,
    until the feed ends or ``stopped`` is set.

    Raises:
        OSError: the feed could not be reached (no agent, or not this one's).
        FeedError: a frame could not be read.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + address[1:] if address.startswith("@") else address)
        sock.settimeout(0.5)
        buffer = b""
        while not stopped.is_set():
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not chunk:
                return  # the agent closed the feed
            buffer += chunk
            while len(buffer) >= _HEADER.size:
                kind, revision, size = _HEADER.unpack_from(buffer)
                if kind not in (PLAN, CONTROL) or size > MAX_VALUE:
                    raise FeedError(f"plan feed at {address}: not a frame (kind {kind!r})")
                end = _HEADER.size + size
                if len(buffer) < end:
                    break
                yield kind, revision, buffer[_HEADER.size : end]
                buffer = buffer[end:]
    finally:
        sock.close()
