"""Backoff between etcd attempts: doubling, capped, and jittered so clients spread out."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from orchestrator.api import EtcdUnavailableError
from orchestrator.etcd import retry
from orchestrator.etcd.retry import Backoff, retry_unavailable

pytestmark = pytest.mark.unit


def test_pauses_double_up_to_the_cap_each_within_the_upper_half() -> None:
    backoff = Backoff(timedelta(seconds=0.1), timedelta(seconds=1), random.Random(7))
    delays = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for delay in delays:
        pause = backoff.next()
        assert delay / 2 <= pause <= delay


def test_clients_that_failed_together_do_not_retry_together() -> None:
    clients = [Backoff(rng=random.Random(seed)) for seed in range(200)]
    for _ in range(5):
        pauses = sorted(c.next() for c in clients)
    # 200 clients, fifth pause (delay 1.6 s): spread over [0.8 s, 1.6 s], not in lockstep.
    assert pauses[0] >= 0.8 and pauses[-1] <= 1.6
    assert pauses[-1] - pauses[0] > 0.6
    assert len({round(p, 3) for p in pauses}) > 150


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="first"):
        Backoff(timedelta(seconds=2), timedelta(seconds=1))
    with pytest.raises(ValueError, match="first"):
        Backoff(timedelta(0))


def test_retry_unavailable_waits_jittered_pauses_then_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", slept.append)
    failures = iter(range(4))

    def call() -> str:
        if next(failures, None) is not None:
            raise EtcdUnavailableError(["e:1"], timedelta(seconds=1), {})
        return "answered"

    assert retry_unavailable(call, "test") == "answered"
    assert len(slept) == 4
    first = retry.FIRST_BACKOFF.total_seconds()
    for i, pause in enumerate(slept):
        delay = min(first * 2**i, retry.MAX_BACKOFF.total_seconds())
        assert delay / 2 <= pause <= delay


def test_retry_unavailable_gives_up_after_max_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry.time, "sleep", lambda s: None)

    def call() -> None:
        raise EtcdUnavailableError(["e:1"], timedelta(seconds=1), {})

    with pytest.raises(EtcdUnavailableError):
        retry_unavailable(call, "test", max_wait=timedelta(0))
