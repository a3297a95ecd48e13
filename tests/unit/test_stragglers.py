"""Stragglers told from the workers' step timings: a scenario table over the pure judgement.

Each scenario feeds :func:`node_timings` and :class:`StragglerWatch` heartbeats
as the controller reads them (running totals per worker) and checks which
nodes are called slow and when.  Real slowdowns (a node's workers stopped and
continued by signals) are in ``tests/integration/test_stragglers.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from agents.runtime.step_timing import StepTiming
from agents.runtime.telemetry import WorkerTelemetry
from orchestrator.controller.stragglers import (
    NodeTiming,
    StragglerWatch,
    node_timings,
    window_starts,
)
from orchestrator.spec.job import StragglerSpec
from orchestrator.state.records import Member, Plan, ProgressRecord, Telemetry

pytestmark = pytest.mark.unit

PLAN = Plan(1, [Member("a", 0, 1), Member("b", 1, 1), Member("c", 2, 1)], spares=["d"])


def _progress(totals: dict[str, Telemetry]) -> dict[str, ProgressRecord]:
    """Each worker's progress record carrying ``totals`` (the rest is not judged)."""
    return {
        w: ProgressRecord(
            step=0,
            generation=t.generation,
            rank=i,
            world_size=len(totals),
            pid=1,
            beat=0.0,
            step_time=0.0,
            telemetry=t,
        )
        for i, (w, t) in enumerate(totals.items())
    }


class Beats:
    """Heartbeats of the plan's workers: running totals, one window at a time."""

    def __init__(self) -> None:
        self.totals = {w: Telemetry(generation=1) for w in ("a-0", "b-0", "c-0")}

    def window(
        self, step_s: dict[str, float], steps: int = 20, changes: dict[str, dict] | None = None
    ) -> None:
        """Every worker steps ``steps`` times; the slowest node sets the step time, the
        others wait for it."""
        pace = max(step_s.values())
        for w, t in self.totals.items():
            compute = step_s[w[0]]
            t = Telemetry(**{**t.__dict__, **(changes or {}).get(w, {})})
            t.compute_s += steps * compute
            t.wait_s += steps * (pace - compute)
            t.timed_steps += steps
            self.totals[w] = t

    def progress(self) -> dict[str, ProgressRecord]:
        return _progress(self.totals)


def _judge(
    watch: StragglerWatch, beats: Beats, step_s: dict[str, float], **kw: object
) -> tuple[dict[str, NodeTiming] | None, tuple[list, list[str]]]:
    before = {w: p.telemetry for w, p in beats.progress().items()}
    beats.window(step_s, **kw)  # type: ignore[arg-type]
    timings = node_timings(before, beats.progress(), PLAN)
    return timings, watch.judge(timings or {})


def a_slow_node_is_called_after_its_windows() -> None:
    watch, beats = StragglerWatch(StragglerSpec(threshold=1.2, windows=3)), Beats()
    healthy = {"a": 0.05, "b": 0.05, "c": 0.05}
    for _ in range(3):
        _, (called, _) = _judge(watch, beats, healthy)
        assert called == []
    slow = {"a": 0.05, "b": 0.075, "c": 0.05}  # 1.5x
    for _ in range(2):
        _, (called, _) = _judge(watch, beats, slow)
        assert called == []
    timings, (called, cleared) = _judge(watch, beats, slow)
    assert timings is not None and timings["a"].wait_s == pytest.approx(0.025)
    (s,) = called
    assert s.node == "b" and s.slowdown == pytest.approx(1.5) and cleared == []
    assert s.wait_s == pytest.approx(0.0) and s.peers_wait_s == pytest.approx(0.025)
    assert "b computes 1.50x as long per step as its peers (75.0 ms against" in s.describe()
    # called once: it stays flagged while it is slow
    assert _judge(watch, beats, slow)[1] == ([], []) and set(watch.flagged) == {"b"}


def noisy_but_healthy_is_never_called() -> None:
    rng = random.Random(7)
    watch, beats = StragglerWatch(StragglerSpec(threshold=1.2, windows=3)), Beats()
    for _ in range(500):  # +-10 % per window, and now and then one window of +40 %
        step_s = {n: 0.05 * rng.uniform(0.9, 1.1) for n in "abc"}
        if rng.random() < 0.05:
            step_s[rng.choice("abc")] *= 1.4
        _, (called, _) = _judge(watch, beats, step_s)
        assert called == [], called


def a_save_in_the_window_is_not_judged() -> None:
    watch, beats = StragglerWatch(StragglerSpec(windows=1)), Beats()
    saved = {"a-0": {"checkpoint_blocking_s": 0.3}}
    timings, verdict = _judge(watch, beats, {"a": 0.2, "b": 0.05, "c": 0.05}, changes=saved)
    assert timings is None and verdict == ([], [])


def a_new_generation_starts_the_totals_over() -> None:
    watch, beats = StragglerWatch(StragglerSpec(windows=1)), Beats()
    newer = {"c-0": {"generation": 2}}
    timings, _ = _judge(watch, beats, {"a": 0.05, "b": 0.05, "c": 0.2}, changes=newer)
    assert timings is None


def too_few_steps_say_nothing_of_a_node() -> None:
    watch, beats = StragglerWatch(StragglerSpec(windows=1)), Beats()
    timings, (called, _) = _judge(watch, beats, {"a": 0.05, "b": 0.05, "c": 0.5}, steps=2)
    assert timings == {} and called == []


def a_recovered_node_is_cleared_then_called_again() -> None:
    watch, beats = StragglerWatch(StragglerSpec(threshold=1.2, windows=2)), Beats()
    slow, healthy = {"a": 0.05, "b": 0.05, "c": 0.15}, {"a": 0.05, "b": 0.05, "c": 0.05}
    results = [_judge(watch, beats, slow)[1] for _ in range(2)]
    assert [s.node for s in results[1][0]] == ["c"]
    # one fast window is not enough (cool-down), two are
    assert _judge(watch, beats, healthy)[1] == ([], [])
    assert _judge(watch, beats, slow)[1] == ([], [])  # slow again: the streak starts over
    assert _judge(watch, beats, healthy)[1] == ([], [])
    assert _judge(watch, beats, healthy)[1] == ([], ["c"]) and watch.flagged == {}
    assert _judge(watch, beats, slow)[1] == ([], [])
    assert [s.node for s in _judge(watch, beats, slow)[1][0]] == ["c"]


def one_node_with_timings_has_no_peers() -> None:
    watch = StragglerWatch(StragglerSpec(windows=1))
    assert watch.judge({"a": NodeTiming(0.5, 0.0, 10)}) == ([], [])


def two_nodes_the_slower_is_called() -> None:
    watch = StragglerWatch(StragglerSpec(windows=1))
    called, _ = watch.judge({"a": NodeTiming(0.05, 0.05, 10), "b": NodeTiming(0.1, 0.0, 10)})
    assert [s.node for s in called] == ["b"] and watch.slowdowns["a"] == 0.5


def what_a_slow_node_costs_is_summed_from_its_first_slow_window() -> None:
    watch, beats = StragglerWatch(StragglerSpec(threshold=1.2, windows=2)), Beats()
    slow = {"a": 0.05, "b": 0.1, "c": 0.05}  # b costs 20 x 50 ms = 1 s a window
    healthy = {"a": 0.05, "b": 0.05, "c": 0.05}
    _judge(watch, beats, slow)
    assert watch.lost == {"b": pytest.approx(1.0)}
    _judge(watch, beats, healthy)  # the streak breaks before the call: the sum starts over
    assert watch.lost == {}
    _judge(watch, beats, slow)
    assert [s.node for s in _judge(watch, beats, slow)[1][0]] == ["b"]
    assert watch.lost["b"] == pytest.approx(2.0)  # both windows of the streak count
    _judge(watch, beats, {"a": 0.05, "b": 0.055, "c": 0.05})  # under the threshold, still
    assert watch.lost["b"] == pytest.approx(2.1)  # called: what it costs still counts
    _judge(watch, beats, healthy)
    assert watch.flagged == {} and watch.lost == {}  # cleared: its cost is forgotten


def _tick(
    watch: StragglerWatch, beats: Beats, step_s: dict[str, float], steps: int, at: list[float]
) -> tuple[list, list[str]]:
    """One heartbeat interval of ``steps`` steps, then the controller's tick."""
    beats.window(step_s, steps=steps)
    at[0] += watch.window_s
    return watch.tick(PLAN, beats.progress(), at[0])


def a_job_of_long_steps_is_judged_every_window() -> None:
    # 1 step per 2 s window: each window reaches back to the last 3 steps
    watch, beats, at = StragglerWatch(StragglerSpec(threshold=1.2, windows=5)), Beats(), [0.0]
    healthy, slow = {"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 1.0, "b": 1.0, "c": 3.0}
    for _ in range(6):
        assert _tick(watch, beats, healthy, 1, at) == ([], [])
    assert watch.timings["c"].steps == 3 and watch.timings["c"].new_steps == 1
    verdicts = [_tick(watch, beats, slow, 1, at) for _ in range(5)]
    assert [v[0] for v in verdicts[:4]] == [[], [], [], []]
    (called,) = verdicts[4][0]  # the fifth window in a row above the threshold
    assert called.node == "c" and called.slowdown == pytest.approx(3.0)
    # what it cost the job, counted over each window's new step only (at most 2 s a
    # step; less while its window still held healthy steps): never twice
    assert 6.0 < watch.lost["c"] <= 10.0


def a_window_reaches_back_neither_over_a_save_nor_into_another_generation() -> None:
    def ends(steps: int, saved: float | None = None, generation: int = 1) -> Telemetry:
        return Telemetry(generation=generation, timed_steps=steps, checkpoint_blocking_s=saved)

    history = [
        {"a-0": ends(10), "b-0": ends(10), "c-0": ends(10)},
        {"a-0": ends(11), "b-0": ends(11), "c-0": ends(11)},
        {"a-0": ends(12, saved=0.3), "b-0": ends(12), "c-0": ends(0, generation=2)},
    ]
    now = {"a-0": ends(13, saved=0.3), "b-0": ends(13), "c-0": ends(1, generation=2)}
    progress = _progress(now)
    starts = window_starts(history, progress)
    assert starts["b-0"].timed_steps == 10  # 3 steps back
    assert starts["a-0"].timed_steps == 12  # not over its save: 1 step, not judged
    assert starts["c-0"].generation == 2  # not into the last generation
    assert node_timings(starts, progress, PLAN, latest=history[-1]) == {
        "b": NodeTiming(0.0, 0.0, 3, 1)
    }


SCENARIOS: list[Callable[[], None]] = [
    a_slow_node_is_called_after_its_windows,
    noisy_but_healthy_is_never_called,
    a_save_in_the_window_is_not_judged,
    a_new_generation_starts_the_totals_over,
    too_few_steps_say_nothing_of_a_node,
    a_recovered_node_is_cleared_then_called_again,
    one_node_with_timings_has_no_peers,
    two_nodes_the_slower_is_called,
    what_a_slow_node_costs_is_summed_from_its_first_slow_window,
    a_job_of_long_steps_is_judged_every_window,
    a_window_reaches_back_neither_over_a_save_nor_into_another_generation,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_stragglers(scenario: Callable[[], None]) -> None:
    scenario()


def test_step_timing_splits_a_step_into_compute_and_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 1.1, 1.4, 1.5, 2.0, 3.0])
    monkeypatch.setattr("agents.runtime.step_timing.time.monotonic", lambda: next(clock))
    timing = StepTiming()
    timing.step_done()  # 0.0: the generation's first step starts the clock only
    timing.posted()  # 1.0: the first bucket
    timing.posted()  # 1.1: the last bucket: backward done
    timing.completed()  # 1.4: its reduction done (waited 0.3 s for the peers)
    timing.step_done()  # 1.5
    assert (timing.steps, timing.wait_s) == (1, pytest.approx(0.3))
    assert timing.compute_s == pytest.approx(1.2)
    timing.step_done()  # 2.0: a step without a gradient exchange is not timed
    assert timing.steps == 1
    timing.reset()
    timing.step_done()  # 3.0: after a reset, the clock starts again
    assert timing.steps == 1


def test_untimed_telemetry_reads_no_clock_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stragglers.action: off`` times nothing: the step loop reads no clock for it."""

    def no_clock() -> float:
        raise AssertionError("an untimed step read the step-timing clock")

    monkeypatch.setattr("agents.runtime.step_timing.time.monotonic", no_clock)
    telemetry = WorkerTelemetry(timed=False)
    telemetry.group_formed(1)
    for _ in range(3):
        telemetry.step_done(None, [])
    record = telemetry.record()
    assert (record.compute_s, record.wait_s, record.timed_steps) == (0.0, 0.0, 0)
    assert WorkerTelemetry().timing is not None  # timed unless told otherwise
