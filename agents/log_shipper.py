"""Tee a worker's output to the agent's own output and to etcd (``ringmaster logs``).

One :class:`LogShipper` per worker process.  A reader thread passes every
line on to ``sink`` at once (a local run shows it live, prefixed by node) and
queues it; every ``flush_every`` the queued lines go to etcd as one
:class:`~orchestrator.records.LogChunk` (:mod:`orchestrator.observe.logs`
has the layout and reads them).  Once this worker's chunks exceed
``keep_bytes``, the oldest are deleted.  etcd being unreachable never blocks
or kills the worker: lines wait (bounded) and go with the next flush.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import IO

from agents.messages import one_line
from orchestrator import keys
from orchestrator.etcd.client import EtcdClient
from orchestrator.records import LogChunk

log = logging.getLogger("ringmaster.agent")

#: Longest line kept (characters); the rest is cut and marked.
MAX_LINE = 4000


class LogShipper:
    def __init__(
        self,
        client: EtcdClient,
        job: str,
        node: str,
        local_rank: int,
        sink: IO[bytes],
        *,
        flush_every: float = 0.5,
        keep_bytes: int = 1 << 20,
        max_pending: int = 10_000,
    ) -> None:
        self.client = client
        self.prefix = keys.worker_logs(job, node, local_rank)
        self.node, self.local_rank = node, local_rank
        self.sink = sink
        self.flush_every = flush_every
        self.keep_bytes = keep_bytes
        self._pending: deque[tuple[float, str]] = deque(maxlen=max_pending)
        self._lock = threading.Lock()
        self._written: deque[tuple[str, int]] = deque()  # (key, size) oldest first
        self._written_bytes = 0
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._tail: deque[str] = deque(maxlen=20)

    def start(self, stream: IO[bytes]) -> LogShipper:
        """Read ``stream`` until EOF in the background."""
        for target, args in ((self._read, (stream,)), (self._flush_loop, ())):
            t = threading.Thread(target=target, args=args, daemon=True, name="log-shipper")
            t.start()
            self._threads.append(t)
        return self

    def join(self, timeout: float = 5.0) -> None:
        """Wait for EOF and the last flush."""
        for t in self._threads:
            t.join(timeout)

    def last_error(self, wait: float = 1.0) -> str | None:
        """After the worker exited: the line that names its error, if it printed one.

        That is the last line of a Python traceback (``SomeError: message``),
        else the last line printed.
        """
        self._done.wait(wait)  # the pipe drains after the process is gone
        with self._lock:
            tail = list(self._tail)
        for line in reversed(tail):
            head = line.split(":", 1)[0]
            named = ":" in line and not line[:1].isspace() and head.replace(".", "").isidentifier()
            if named and head.endswith(("Error", "Exception", "Exit", "Interrupt")):
                return one_line(line, 300)
        return one_line(tail[-1], 300) if tail else None

    def _read(self, stream: IO[bytes]) -> None:
        try:
            for raw in iter(stream.readline, b""):
                with contextlib.suppress(OSError, ValueError):
                    self.sink.write(raw)
                    self.sink.flush()
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if len(text) > MAX_LINE:
                    text = text[:MAX_LINE] + " [line cut]"
                with self._lock:
                    self._pending.append((time.time(), text))
                    if text.strip():
                        self._tail.append(text)
        finally:
            self._done.set()

    def _flush_loop(self) -> None:
        while not self._done.wait(self.flush_every):
            self.flush()
        self.flush()

    def flush(self) -> None:
        with self._lock:
            lines = list(self._pending)
            self._pending.clear()
        if not lines:
            return
        key = f"{self.prefix}{time.time_ns():020d}"
        data = LogChunk(self.node, self.local_rank, lines).encode().encode()
        try:
            self.client.put(key, data)
        except Exception as e:  # etcd away: keep the lines for the next flush
            log.debug("log chunk not shipped (%s); retrying", e)
            with self._lock:
                self._pending.extendleft(reversed(lines))
            return
        self._written.append((key, len(data)))
        self._written_bytes += len(data)
        while self._written_bytes > self.keep_bytes and len(self._written) > 1:
            old, size = self._written.popleft()
            self._written_bytes -= size
            with contextlib.suppress(Exception):
                self.client.delete(old)
