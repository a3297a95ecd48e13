"""The progress channel, a worker's end: its beats and break reports go to its node agent.

Runs in the training process.  The agent's end, which writes what arrives to etcd
as one record per node, is :class:`agents.node.progress_relay.ProgressRelay`.
Messages are JSON datagrams on an abstract Unix socket; every reply carries a
sequence number and how long etcd has been away for the agent.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from orchestrator.api import EtcdError
from orchestrator.state.records import BreakReport, ProgressRecord

#: The environment variable that names the agent's progress socket (``@`` + an
#: abstract socket name); without it a worker writes its own progress to etcd.
ENV_PROGRESS_SOCKET = "RINGMASTER_PROGRESS_SOCKET"
#: A worker whose agent has had etcd away this long checks etcd itself.
AWAY_CHECK_S = 1.0
#: How long a worker waits for its agent's reply to a beat (a synchronous one: to the write).
REPLY_TIMEOUT_S = 0.5
SYNC_TIMEOUT_S = 10.0
#: How long a worker waits for its agent to write its break report before it writes its own.
REPORT_TIMEOUT_S = 2.0
#: Largest message (a ProgressRecord is under 1 KiB; metrics are a few numbers).
MAX_MESSAGE = 256 * 1024


class RelayError(EtcdError):
    """A worker's progress did not reach etcd through its node agent in time."""


class RelayLink:
    """A worker's side: sends its records to the agent, learns how etcd is for the agent.

    Args:
        address: the agent's socket (:data:`ENV_PROGRESS_SOCKET`'s value).
        worker: this worker's id.
    """

    def __init__(self, address: str, worker: str) -> None:
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.worker = worker
        self._sock: socket.socket | None = None
        self._seq = 0
        self._lock = threading.Lock()  # a beat_now and the heartbeat thread's beat
        #: how long etcd had been away for the agent, and when (monotonic) it said so
        self._away = (0.0, time.monotonic())

    def send(self, record: ProgressRecord, sync: bool) -> None:
        """Send ``record``; with ``sync``, wait until the agent wrote it to etcd.

        Raises:
            RelayError: ``sync``, and the agent did not write it within
                :data:`SYNC_TIMEOUT_S` (etcd is away, or the agent is).
        """
        with self._lock:
            self._send(record, sync)

    def _send(self, record: ProgressRecord, sync: bool) -> None:
        msg = {"worker": self.worker, "sync": sync, "record": record.to_dict()}
        try:
            replied = self._exchange(msg, SYNC_TIMEOUT_S if sync else REPLY_TIMEOUT_S)
        except OSError as e:  # the agent is gone (its workers die with it) or swamped
            if sync:
                raise RelayError(
                    f"progress of {self.worker} not relayed: the node agent's socket "
                    f"{self.address[1:]!r} refused it ({e})"
                ) from e
            return
        if sync and replied is None:
            raise RelayError(
                f"progress of {self.worker} not written by the node agent within "
                f"{SYNC_TIMEOUT_S:g}s: etcd or the agent is not answering"
            )

    def report(self, generation: int, report: BreakReport) -> bool:
        """Have the agent write this worker's report that ``generation`` broke.

        Returns:
            True once it is in etcd; False when the agent did not take it within
            :data:`REPORT_TIMEOUT_S` (the worker then writes its own).
        """
        msg = {
            "kind": "report",
            "worker": self.worker,
            "generation": int(generation),
            "report": report.to_dict(),
        }
        with self._lock:
            try:
                replied = self._exchange(msg, REPORT_TIMEOUT_S)
            except OSError:
                return False
        return replied is not None and bool(replied.get("written"))

    def _exchange(self, msg: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """Send ``msg`` (numbered here) and wait up to ``timeout`` for its answer (None: none).

        Raises:
            OSError: the agent's socket refused it.
        """
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.bind("")  # an abstract name of the kernel's choice, for the replies
        self._seq += 1
        seq = self._seq
        self._sock.sendto(json.dumps({"seq": seq, **msg}).encode(), self.address)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self._sock.settimeout(left)
            try:
                reply = json.loads(self._sock.recv(MAX_MESSAGE))
            except (TimeoutError, OSError, ValueError):
                return None
            if int(reply.get("seq", -1)) == seq:
                self._away = (float(reply.get("away", 0.0)), time.monotonic())
                return dict(reply)
        return None

    def agent_away_for(self) -> float:
        """How long etcd has been away for the agent, as of its last reply (0: all is well)."""
        away, at = self._away
        return away + (time.monotonic() - at) if away > 0 else 0.0

    def close(self) -> None:
        """Close the socket (a later :meth:`send` opens another)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
