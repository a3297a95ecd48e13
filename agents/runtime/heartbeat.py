"""The worker's heartbeat: its progress, published to etcd from a thread.

The controller reads a worker's :class:`~orchestrator.state.records.ProgressRecord`
to follow the job (step, rate, loss), to time recoveries (the telemetry in
it) and to detect hangs: a worker whose beats stop while its step does not
move is frozen.  Beating from a thread keeps the training loop off etcd;
:meth:`Heartbeat.poke` asks for a beat soon (after a step boundary or a new
generation) without waiting for it; pokes closer together than
:data:`MIN_BEAT_GAP` are served by one beat, so a fast loop (a step every
10 ms) writes to etcd a few times a second, not at every step.

Started by a node agent (:data:`agents.channels.progress.ENV_PROGRESS_SOCKET` set),
a worker does not write to etcd itself: it sends its record to its agent,
which writes one record for all of the node's workers
(:mod:`agents.node.progress_relay`).  The agent's replies say whether etcd is away
for it; when it has been for :data:`~agents.channels.progress.AWAY_CHECK_S`, the
beat also writes the worker's own progress key with the worker's own client,
so that the worker's ``EtcdClient.unreachable_for`` sees the outage and the
runtime pauses at its next step boundary.  A write, not a read: while etcd
refuses writes for want of space (its NOSPACE alarm) reads still answer.  The
controller reads both kinds of record; the newer beat wins.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from agents.channels.progress import AWAY_CHECK_S, ENV_PROGRESS_SOCKET, RelayLink
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import records
from orchestrator.state.records import BreakReport, ProgressRecord

__all__ = ["MIN_BEAT_GAP", "Heartbeat", "ProgressSource"]

#: ``(beat, step_time) -> record``: the worker's progress as of ``beat``
#: (wall-clock seconds), whose step counter last moved at ``step_time``.
ProgressSource = Callable[[float, float], ProgressRecord]

#: Shortest time between two beats: the controller reads progress once a tick
#: (``orchestrator.controller.service.TICK``, 0.2 s), so more often is wasted
#: on etcd and on the training process.
MIN_BEAT_GAP = 0.2


class Heartbeat:
    """Publishes progress at ``key`` every ``interval`` (a frozen process stops beating).

    Args:
        client: the etcd client.
        key: the worker's progress key.
        step: ``() -> int``, the worker's current step (to time the last move).
        progress: builds the record to publish.
        interval: time between beats.
        relay: the node agent's progress socket; None: the one named in the
            environment (:data:`~agents.channels.progress.ENV_PROGRESS_SOCKET`);
            empty: none, the worker writes its progress to etcd itself.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        step: Callable[[], int],
        progress: ProgressSource,
        interval: timedelta,
        relay: str | None = None,
    ) -> None:
        self._client = client
        self._key = key
        address = os.environ.get(ENV_PROGRESS_SOCKET, "") if relay is None else relay
        self._relay = RelayLink(address, key.rsplit("/", 1)[1]) if address else None
        self._step = step
        self._progress = progress
        self._interval = interval.total_seconds()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_step = -1
        self._step_time = time.time()

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            # pokes within MIN_BEAT_GAP of the last beat wait for the gap, then share a beat
            if self._stop.wait(max(0.0, last + MIN_BEAT_GAP - time.monotonic())):
                return
            self._wake.clear()
            last = time.monotonic()
            with contextlib.suppress(Exception):
                self._beat(sync=False)

    def poke(self) -> None:
        """Beat soon, from the heartbeat thread (the training loop never waits on etcd)."""
        self._wake.set()

    def beat_now(self) -> None:
        """Publish the progress now: in etcd when this returns (relayed or not).

        Raises:
            EtcdError: etcd did not answer (or, relayed, the agent did not write it).
        """
        self._beat(sync=True)

    def _beat(self, sync: bool) -> None:
        now = time.time()
        step = self._step()
        if step != self._last_step:
            self._last_step = step
            self._step_time = now
        record = self._progress(now, self._step_time)
        if self._relay is None:
            records.write(self._client, self._key, record)
            return
        self._relay.send(record, sync=sync)
        if self._relay.agent_away_for() > AWAY_CHECK_S:
            # etcd is away for the agent: find out with this worker's own client, by a
            # write (a read answers while etcd refuses writes for want of space)
            records.write(self._client, self._key, record)

    def relay_report(self, generation: int, report: BreakReport) -> bool:
        """Have the node agent write this worker's break report (see
        :meth:`RelayLink.report <agents.channels.progress.RelayLink.report>`); False:
        no agent took it, the caller writes it itself."""
        return self._relay is not None and self._relay.report(generation, report)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._relay is not None:
            self._relay.close()
