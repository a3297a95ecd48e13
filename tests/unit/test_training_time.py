"""Where a run's wall time went: closed-form cases of the one definition, and the
checkpoint stalls the workers count for it."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from agents.runtime.telemetry import WorkerTelemetry
from orchestrator.cli.local_commands import time_table
from orchestrator.observe.records import RecoveryRecord
from orchestrator.observe.training_time import (
    PARTS,
    TrainingTime,
    time_parts,
    time_rows,
    training_time,
)

pytestmark = pytest.mark.unit


def recovery(failure_at: float, first_step_at: float, step: int = 40, restored: int = 40):
    """A recovery from ``failure_at`` to ``first_step_at`` (re-running ``step - restored``)."""
    return RecoveryRecord(
        generation=2,
        cause="agent_gone",
        nodes=["node-1"],
        reason="",
        failure_at=failure_at,
        declared_at=failure_at,
        group_formed_at=first_step_at,
        restored_at=first_step_at,
        first_step_at=first_step_at,
        step=step,
        restored_step=restored,
    )


def split(**kw: object) -> TrainingTime:
    args: dict[str, object] = dict(
        submitted_at=0.0, train_started_at=10.0, last_step_at=110.0, end=110.0, recoveries=[]
    )
    args.update(kw)
    return training_time(**args)  # type: ignore[arg-type]


def adds_up(t: TrainingTime) -> None:
    assert sum(time_parts(t).values()) == pytest.approx(t.wall_s)
    assert t.startup_s + t.since_first_step_s == pytest.approx(t.wall_s)
    assert t.failures_s == pytest.approx(t.recovering_s + t.rerun_s)
    assert all(v >= 0 for v in dataclasses.asdict(t).values())


def test_no_failures_every_second_since_the_first_step_is_productive() -> None:
    t = split(steps=1000)
    adds_up(t)
    assert (t.wall_s, t.startup_s, t.since_first_step_s) == (110.0, 10.0, 100.0)
    assert t.productive_s == pytest.approx(100.0) and t.step_s == pytest.approx(0.1)
    assert t.failures_s == t.checkpoint_s == 0 and t.other_s == pytest.approx(0)
    assert t.effective == pytest.approx(1.0)
    assert t.whole_run == pytest.approx(100 / 110)


def test_one_failure_costs_its_recovery_and_the_steps_run_again_not_the_start_up() -> None:
    # 3 s from the failure to the new generation's first step; restored from step 30
    # after reaching 40: 10 steps trained twice.  97 s of stepping for 960 + 10 steps.
    t = split(steps=960, recoveries=[recovery(50.0, 53.0, step=40, restored=30)])
    adds_up(t)
    assert t.startup_s == 10.0
    assert t.step_s == pytest.approx(0.1)
    assert t.recovering_s == pytest.approx(3.0) and t.rerun_s == pytest.approx(1.0)
    assert t.failures_s == pytest.approx(4.0)
    assert t.productive_s == pytest.approx(96.0)
    assert t.effective == pytest.approx(0.96) and t.whole_run == pytest.approx(96 / 110)


def test_a_checkpoint_stall_is_a_line_of_its_own_not_step_time() -> None:
    t = split(steps=900, checkpoint_stall_s=10.0)
    adds_up(t)
    assert t.checkpoint_s == 10.0
    assert t.step_s == pytest.approx(0.1) and t.productive_s == pytest.approx(90.0)
    assert t.failures_s == 0 and t.effective == pytest.approx(0.9)


def test_start_up_only_before_the_first_step() -> None:
    t = split(train_started_at=None, last_step_at=None, end=15.0, steps=0)
    adds_up(t)
    assert t.wall_s == t.startup_s == 15.0
    assert t.since_first_step_s == t.productive_s == t.effective == t.whole_run == 0


def test_a_failure_before_the_first_step_is_start_up() -> None:
    t = split(steps=1000, recoveries=[recovery(4.0, 9.0)])
    adds_up(t)
    assert t.startup_s == 10.0 and t.failures_s == 0 and t.effective == pytest.approx(1.0)


def test_a_failure_under_way_counts_up_to_now_and_the_time_after_the_last_step_is_other() -> None:
    t = split(last_step_at=50.0, end=60.0, steps=400, failing_since=52.0)
    adds_up(t)
    assert t.productive_s == pytest.approx(40.0)
    assert t.recovering_s == pytest.approx(8.0)  # 52 → 60, still recovering
    assert t.other_s == pytest.approx(2.0)  # 50 → 52: after the last step, before the failure
    assert t.effective == pytest.approx(40 / 50)


def test_effective_training_is_the_benchmarks_goodput() -> None:
    """benchmarks/peers.py: steps gained x fault-free step time / window from the first step."""
    t = split(end=120.0, steps=900, recoveries=[recovery(60.0, 62.5)], checkpoint_stall_s=1.5)
    adds_up(t)
    assert t.effective == pytest.approx(900 * t.step_s / (120.0 - 10.0))


@pytest.mark.parametrize(
    "kw",
    [
        # overlapping recoveries count once; a stall longer than the stepping is clamped
        dict(steps=10, recoveries=[recovery(20, 40), recovery(30, 50)], checkpoint_stall_s=500),
        # a recovery that ends after the latest step; no step gained
        dict(steps=0, recoveries=[recovery(100, 130)], end=140.0),
        # a first step reported before the submission (clocks of two hosts)
        dict(steps=5, train_started_at=-1.0),
    ],
)
def test_the_parts_add_up_to_the_wall_time_whatever_the_inputs(kw: dict[str, object]) -> None:
    adds_up(split(**kw))


def test_people_read_the_same_lines_in_status_the_report_and_the_run_table() -> None:
    t = split(steps=960, recoveries=[recovery(50.0, 53.0, step=40, restored=30)])
    rows = dict(time_rows(t))
    assert list(rows) == [
        "start-up",
        "productive",
        "lost to failures",
        "checkpoint stalls",
        "other",
        "effective training",
    ]
    assert rows["start-up"].startswith("10.0s")
    assert rows["lost to failures"] == "4.00s (recovering 3.00s, steps re-run 1.00s)"
    assert rows["effective training"].startswith(
        "96.0% since the first step (87.3% of the whole run)"
    )
    out = io.StringIO()
    Console(file=out, width=80, force_terminal=False).print(time_table(t))
    text = " ".join(out.getvalue().split())
    assert "…" not in text
    for word in ("start-up", "productive", "failures", "checkpoint", "stalls", "10.0s", "4.00s"):
        assert word in text, text
    assert "96.0%" in text and "87.3%" in text
    assert list(time_parts(t)) == list(PARTS)


def test_a_worker_counts_save_stalls_between_its_first_and_latest_step() -> None:
    tel = WorkerTelemetry(timed=False)
    tel.checkpoint_blocked(5.0)  # before the first step: start-up, not a stall
    tel.step_done(None, [])
    assert tel.record().checkpoint_stall_s == 0
    tel.checkpoint_blocked(0.25)
    assert tel.record().checkpoint_stall_s == 0  # after the latest step: not yet
    tel.step_done(None, [])
    tel.checkpoint_failed(0.5)  # a failed save stalled the loop too
    tel.step_done(None, [])
    record = tel.record()
    assert record.checkpoint_stall_s == pytest.approx(0.75)
    assert record.checkpoint_blocking_s == 0.25  # the last save's own time, as before
    tel.group_formed(2)  # a new generation of the same process keeps counting
    tel.checkpoint_blocked(1.0)
    tel.step_done(None, [])
    assert tel.record().checkpoint_stall_s == pytest.approx(1.75)
