"""Tee a worker's output to the agent's own output and to files on the node.

One :class:`LogShipper` per worker process.  A reader thread passes every
byte on to ``sink`` at once (the agent's stdout: the kubelet's log, and a
local run shows it live) and writes every line, with its time, to the
worker's rotated files (:mod:`agents.node.log_files`), which ``ringmaster logs``
reads through the agent's liveness port while the agent lives.

etcd carries no stream of output: when the worker's output ends (it exited),
its last :data:`TAIL_LINES` lines, at most :data:`TAIL_BYTES`, go to one key
(:func:`orchestrator.state.keys.worker_log_tail`, a
:class:`~orchestrator.state.records.LogChunk`), overwritten at the next exit.  That
is what ``ringmaster logs`` shows of a node whose agent is gone, and what
tells the failure's cause.  The write is tried once (the client retries what
is transient); a refused or failed one is logged and dropped, never queued.

A line is kept up to :data:`MAX_LINE` characters and cut beyond, however long
it is: the reader never holds more than :data:`READ_CHUNK` bytes of it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO

from agents.messages import one_line
from agents.node import log_files
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys
from orchestrator.state.records import LogChunk

log = logging.getLogger("ringmaster.agent")

#: Longest line kept (characters); the rest is cut and marked.
MAX_LINE = 4000
#: Most bytes of a line read at once (a longer line comes in pieces).
READ_CHUNK = 64 * 1024
#: Lines kept in etcd at a worker's exit, and their most bytes (the record, encoded).
TAIL_LINES = 50
TAIL_BYTES = 16 * 1024
#: Longest line kept in the etcd tail (characters).
TAIL_LINE = 1000
#: What marks a cut line.
CUT = " [line cut]"


class LogShipper:
    """Reads one worker's output: tees it, files it, and stores its tail in etcd at the end.

    Args:
        client: etcd, for the tail at the end.
        job / node / local_rank: whose output it is.
        sink: where every byte is passed on as read (the agent's stdout).
        log_dir: the node's log directory (default
            :func:`agents.node.log_files.node_dir` under ``RINGMASTER_LOG_DIR``); the
            worker's files are in ``<log_dir>/<local_rank>/``.
        keep_bytes: bytes of files kept (default ``RINGMASTER_LOG_KEEP_MIB``).
        tail_lines / tail_bytes: the bounds of the tail stored in etcd.
    """

    def __init__(
        self,
        client: EtcdClient,
        job: str,
        node: str,
        local_rank: int,
        sink: IO[bytes],
        *,
        log_dir: Path | None = None,
        keep_bytes: int | None = None,
        tail_lines: int = TAIL_LINES,
        tail_bytes: int = TAIL_BYTES,
    ) -> None:
        self.client = client
        self.job, self.node, self.local_rank = job, node, local_rank
        self.sink = sink
        self.tail_bytes = tail_bytes
        directory = log_dir or log_files.node_dir(log_files.default_root(), job, node)
        self.directory = directory / str(int(local_rank))
        self._file: log_files.WorkerLog | None = None
        try:
            self._file = log_files.WorkerLog(
                self.directory, keep_bytes if keep_bytes is not None else log_files.keep_bytes()
            )
        except OSError as e:
            log.warning(
                "[%s] cannot write worker %d's output under %s (%s): it goes to stdout only;"
                " set RINGMASTER_LOG_DIR to a writable directory",
                node,
                local_rank,
                directory,
                e,
            )
        self._lock = threading.Lock()
        self._tail: deque[tuple[float, str]] = deque(maxlen=max(tail_lines, 1))
        self._eof = threading.Event()
        self._threads: list[threading.Thread] = []
        #: when the worker's first line of output was read (wall clock; None before)
        self.first_output_at: float | None = None

    def start(self, stream: IO[bytes]) -> LogShipper:
        """Read ``stream`` until EOF in the background (then close it), then store the tail."""
        t = threading.Thread(target=self._read, args=(stream,), daemon=True, name="log-shipper")
        t.start()
        self._threads.append(t)
        return self

    def join(self, timeout: float = 5.0) -> None:
        """Wait for EOF and the tail's write."""
        for t in self._threads:
            t.join(timeout)

    def last_error(self, wait: float = 1.0) -> str | None:
        """After the worker exited: the line that names its error, if it printed one.

        That is the last line of a Python traceback (``SomeError: message``),
        else the last line printed.
        """
        self._eof.wait(wait)  # the pipe drains after the process is gone
        with self._lock:
            tail = [text for _, text in self._tail if text.strip()]
        for line in reversed(tail):
            head = line.split(":", 1)[0]
            named = ":" in line and not line[:1].isspace() and head.replace(".", "").isidentifier()
            if named and head.endswith(("Error", "Exception", "Exit", "Interrupt")):
                return one_line(line, 300)
        return one_line(tail[-1], 300) if tail else None

    def write_lines(self, lines: list[tuple[float, str]]) -> None:
        """Keep ``(time, text)`` lines as if read from the worker (the reader's own path)."""
        for at, text in lines:
            self._keep(at, text)

    def _read(self, stream: IO[bytes]) -> None:
        try:
            cutting = False  # inside a line already kept (cut): skip to its end
            for raw in iter(lambda: _read_piece(stream), b""):
                with contextlib.suppress(OSError, ValueError):
                    self.sink.write(raw)
                    self.sink.flush()
                whole = raw.endswith(b"\n")
                if not cutting:
                    text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                    long = not whole and len(raw) >= READ_CHUNK
                    if long or len(text) > MAX_LINE:
                        text = text[:MAX_LINE] + CUT
                    at = time.time()
                    if self.first_output_at is None and text.strip():
                        self.first_output_at = at
                    self._keep(at, text)
                    cutting = long
                elif whole:
                    cutting = False
        finally:
            with contextlib.suppress(OSError, ValueError):
                stream.close()  # the pipe is this reader's: a long-lived agent leaks none
            self._eof.set()
            if self._file is not None:
                self._file.close()
            self.store_tail()

    def _keep(self, at: float, text: str) -> None:
        with self._lock:
            self._tail.append((at, text))
        if self._file is None:
            return
        try:
            self._file.write(at, text)
        except OSError as e:  # a full disk: the output still reaches stdout
            log.warning("[%s] worker %d's log file: %s", self.node, self.local_rank, e)
            self._file.close()
            self._file = None

    def tail_record(self) -> LogChunk | None:
        """The last lines, as stored in etcd: within the line and byte bounds; None if none."""
        with self._lock:
            lines = list(self._tail)
        lines = [(at, t if len(t) <= TAIL_LINE else t[:TAIL_LINE] + CUT) for at, t in lines]
        while lines:
            chunk = LogChunk(self.node, self.local_rank, lines)
            if len(chunk.encode().encode()) <= self.tail_bytes:
                return chunk
            lines = lines[max(1, len(lines) // 4) :]
        return None

    def store_tail(self) -> None:
        """Write the tail to etcd, once; a failure is logged, never retried from here."""
        chunk = self.tail_record()
        if chunk is None:
            return
        key = keys.worker_log_tail(self.job, self.node, self.local_rank)
        try:
            self.client.put(key, chunk.encode().encode())
        except Exception as e:  # etcd away or refusing: the files still hold everything
            log.warning(
                "[%s] the last lines of worker %d were not stored in etcd (%s); its whole"
                " output is in %s on this node",
                self.node,
                self.local_rank,
                e,
                self.directory,
            )


def _read_piece(stream: IO[bytes]) -> bytes:
    """The next line, or its next :data:`READ_CHUNK` bytes; ``b""`` at EOF or once closed."""
    try:
        return stream.readline(READ_CHUNK)
    except (OSError, ValueError):  # the pipe was closed under the reader
        return b""
