"""Save triggers: every N steps, every T seconds, and requests from outside the loop."""

from __future__ import annotations

import os
import signal

import pytest

from checkpoint.triggers import SaveDue, SaveTrigger, request_on_signal

pytestmark = pytest.mark.unit


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_every_steps() -> None:
    t = SaveTrigger(every_steps=5)
    assert [s for s in range(0, 21) if t.due(s)] == [5, 10, 15, 20]


def test_every_seconds_counts_from_the_last_save() -> None:
    clock = _Clock()
    t = SaveTrigger(every_seconds=30, clock=clock)
    assert t.due(1) is None
    clock.now += 30
    assert t.due(2) == "every 30s"
    t.saved()
    assert t.due(3) is None
    clock.now += 29
    assert t.due(4) is None


def test_request_wins_until_served() -> None:
    t = SaveTrigger(every_steps=100)
    t.request("preemption (SIGTERM)")
    assert t.due(7) == "preemption (SIGTERM)"
    assert t.due(8) == "preemption (SIGTERM)"
    t.saved()
    assert t.due(9) is None


def test_negative_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="every_steps"):
        SaveTrigger(every_steps=-1)


def test_sigterm_requests_a_save_instead_of_exiting() -> None:
    t = SaveTrigger(every_steps=1000)
    previous = request_on_signal(t)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert t.due(3) == "preemption (SIGTERM)"
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_agreed_inputs_decide_in_place_of_this_process() -> None:
    """The runtime's ranks agree on a request and on the clock; the rule is the same."""
    clock = _Clock()
    t = SaveTrigger(every_steps=10, every_seconds=30, clock=clock)
    t.request("mine")
    assert t.decide(3, requested="agreed") == SaveDue("agreed", requested=True)
    t.saved()
    clock.now += 31
    assert t.time_due()
    assert t.decide(3, time_due=False) is None  # due here, not agreed
    assert t.decide(10, time_due=False) == SaveDue("every 10 steps", requested=False)
    t.saved()
    assert not t.time_due()
    assert t.decide(3, time_due=True) == SaveDue("every 30s", requested=False)  # due elsewhere
