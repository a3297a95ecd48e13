"""The operation timeout learnt from the job's steps, and what ended a step."""

from __future__ import annotations

import pytest

from agents.runtime.collective_guard import WARMUP_STEPS, CollectiveGuard, OpTimeout

pytestmark = pytest.mark.unit


def _warm(t: OpTimeout) -> None:
    for _ in range(WARMUP_STEPS):
        t.observe(30.0)  # warm-up steps are slow and not learnt from
        assert t.current() == t.ceiling


def test_the_ceiling_holds_until_a_generation_has_warmed_up() -> None:
    t = OpTimeout(floor=5, multiple=10, ceiling=600)
    _warm(t)
    t.observe(0.1)
    assert t.current() == 5  # 10 x 0.1 s is under the floor
    t.new_generation()  # a replacement joins: its first steps include its warm-up
    assert t.current() == 600
    for _ in range(WARMUP_STEPS):
        t.observe(2.0)
    assert t.current() == 5  # the history of the earlier generation is kept


def test_the_timeout_follows_the_slowest_recent_step_within_bounds() -> None:
    t = OpTimeout(floor=5, multiple=10, ceiling=600, window=4)
    _warm(t)
    for s in (0.2, 2.0, 0.2, 0.2):
        t.observe(s)
    assert t.current() == pytest.approx(20.0)
    for _ in range(4):  # the slow step leaves the window
        t.observe(0.3)
    assert t.current() == 5
    t.observe(100.0)
    assert t.current() == 600  # never above twice hang_timeout


def test_abort_grace_lets_a_planned_step_end_on_its_own() -> None:
    t = OpTimeout(floor=5, multiple=10, ceiling=600)
    _warm(t)
    t.observe(0.05)
    assert t.abort_grace() == 0.5  # a short floor for fast steps
    t.observe(2.0)
    assert t.abort_grace() == pytest.approx(4.0)


def test_the_timeout_between_sites_follows_the_slowest_recent_outer_sync() -> None:
    t = OpTimeout(floor=5, multiple=10, ceiling=600, window=4)
    _warm(t)
    t.observe(0.1)
    assert (t.current(), t.between_sites()) == (5, 600)  # no outer sync seen yet
    t.observe_outer(50.0)  # a generation's first sync may wait for a site catching up
    assert t.between_sites() == 600
    t.observe_outer(1.5)
    assert t.between_sites() == pytest.approx(15.0)  # 10 x the slowest sync, not the steps'
    t.observe_outer(0.2)
    assert t.between_sites() == pytest.approx(15.0)
    t.new_generation()  # a new generation's first sync is not learnt from either
    assert t.between_sites() == 600
    t.observe_outer(0.1)
    t.observe_outer(0.1)
    assert t.between_sites() == pytest.approx(15.0)  # the window spans generations
    for _ in range(4):
        t.observe_outer(0.1)
    assert t.between_sites() == 5  # the slow one left the window; never under the floor
    t.observe_outer(100.0)
    assert t.between_sites() == 600  # never above twice hang_timeout


def test_ended_by_names_the_mechanism() -> None:
    guard = CollectiveGuard(OpTimeout(5, 10, 600), latest_generation=lambda: 0)
    try:
        gloo_timeout = RuntimeError("Timed out waiting 1500ms for recv operation to complete")
        assert guard.ended_by(gloo_timeout) == "timeout"
        assert guard.ended_by(RuntimeError("Connection reset by peer")) == "error"
    finally:
        guard.close()
