"""Waiting out etcd outages: jittered exponential backoff and :func:`retry_unavailable`.

Every pause between attempts is drawn at random from the upper half of the
current delay ("equal jitter"), and the delay doubles up to a cap.  Plain
doubling would make every client that lost etcd at the same moment (all the
agents and workers of a cluster) retry at the same moments too, so a member
coming back would meet them all at once, again and again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from orchestrator.api import EtcdUnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest pause between two attempts of :func:`retry_unavailable`.
MAX_BACKOFF = timedelta(seconds=2)
#: First pause of :func:`retry_unavailable`.
FIRST_BACKOFF = timedelta(seconds=0.1)


class Backoff:
    """Pauses that double up to ``maximum``, each drawn from ``[delay / 2, delay]``.

    Args:
        first: the first delay (the first pause lies between half of it and it).
        maximum: the largest delay.
        rng: source of randomness (a seeded ``random.Random`` in tests).
    """

    def __init__(
        self,
        first: timedelta = FIRST_BACKOFF,
        maximum: timedelta = MAX_BACKOFF,
        rng: random.Random | None = None,
    ) -> None:
        if first.total_seconds() <= 0 or maximum < first:
            raise ValueError(f"backoff needs 0 < first ({first}) <= maximum ({maximum})")
        self._delay = first.total_seconds()
        self._max = maximum.total_seconds()
        self._rng = rng or random.Random()

    def next(self) -> float:
        """Seconds to pause now; the delay after it doubles (up to the maximum)."""
        pause = self._rng.uniform(self._delay / 2, self._delay)
        self._delay = min(self._delay * 2, self._max)
        return pause


def retry_unavailable(
    fn: Callable[[], T],
    what: str,
    stop: threading.Event | None = None,
    max_wait: timedelta | None = None,
) -> T:
    """Call ``fn`` until etcd answers: retry :class:`EtcdUnavailableError` with backoff.

    For the long-lived processes (agent, controller, worker) an etcd outage is
    a pause, not a crash: they keep their state and carry on when a quorum is
    back.  Other errors (auth, bad request) are raised at once.  Pauses are
    jittered (see :class:`Backoff`).

    Args:
        fn: the etcd operation.
        what: what is being done, for the log.
        stop: give up (re-raising the last error) once this is set.
        max_wait: give up after this long (default: never).

    Raises:
        EtcdUnavailableError: ``stop`` was set or ``max_wait`` passed.
    """
    started = time.monotonic()
    backoff = Backoff()
    warned = False
    while True:
        try:
            result = fn()
        except EtcdUnavailableError as e:
            waited = time.monotonic() - started
            if (stop is not None and stop.is_set()) or (
                max_wait is not None and waited >= max_wait.total_seconds()
            ):
                raise
            if not warned:
                log.warning("%s: etcd unavailable, retrying until it is back: %s", what, e)
                warned = True
            pause = backoff.next()
            if stop is not None:
                stop.wait(pause)
            else:
                time.sleep(pause)
            continue
        if warned:
            log.warning("%s: etcd is back after %.1fs", what, time.monotonic() - started)
        return result
