"""The worker's heartbeat: its progress, published to etcd from a thread.

The controller reads a worker's :class:`~orchestrator.records.ProgressRecord`
to follow the job (step, rate, loss), to time recoveries (the telemetry in
it) and to detect hangs: a worker whose beats stop while its step does not
move is frozen.  Beating from a thread keeps the training loop off etcd;
:meth:`Heartbeat.poke` asks for a beat soon (after a step boundary or a new
generation) without waiting for it; pokes closer together than
:data:`MIN_BEAT_GAP` are served by one beat, so a fast loop (a step every
10 ms) writes to etcd a few times a second, not at every step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from orchestrator import records
from orchestrator.etcd.client import EtcdClient
from orchestrator.records import ProgressRecord

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
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        step: Callable[[], int],
        progress: ProgressSource,
        interval: timedelta,
    ) -> None:
        self._client = client
        self._key = key
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
                self.beat_now()

    def poke(self) -> None:
        """Beat soon, from the heartbeat thread (the training loop never waits on etcd)."""
        self._wake.set()

    def beat_now(self) -> None:
        """Publish the progress now.

        Raises:
            EtcdError: etcd did not answer.
        """
        now = time.time()
        step = self._step()
        if step != self._last_step:
            self._last_step = step
            self._step_time = now
        records.write(self._client, self._key, self._progress(now, self._step_time))

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
