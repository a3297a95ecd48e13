"""Where a run's wall time went: start-up, progress, failures and checkpoint stalls.

The one definition of *effective training*, used by the controller's status,
``ringmaster status``, the table ``ringmaster run`` ends with, the report and
the metrics.  :func:`training_time` splits the wall time of a run, from its
submission to its end (or now), into parts that add up to it::

    submitted ─start-up─► first step ─┬─ productive (steps gained x step time)
                                      ├─ failures (each failure → the first step of
                                      │  its replacement generation, + steps re-run)
                                      ├─ checkpoint stalls (saves blocking the loop)
                                      └─ other (after the latest step)

* start-up: the submission to the first completed step: etcd, the agents,
  warm workers, the script's own setup, the first step itself.  A failure
  before the first step is part of it.
* failures: for each recovery that began after the first step, its failure to
  the first completed step of the generation that replaced the broken one
  (detect, a wait for a spare included, rendezvous, restore, first step:
  :mod:`orchestrator.observe.recoveries`),
  and a failure still being recovered from up to now; plus the completed steps
  trained again (a restore from an older state), at the fault-free step time.
* checkpoint stalls: the time saves blocked rank 0's training loop, as the
  workers measure it (``Telemetry.checkpoint_stall_s``).
* productive: the steps gained since the first step times the fault-free step
  time, which is the time spent stepping (the span from the first step to the
  latest, less recoveries and stalls) over the steps trained in it (re-run ones
  included).
* other: what is left, the time after the latest step (a stop's save, the
  workers exiting, the controller seeing the end).

*Effective training* is ``productive / (wall time since the first completed
step)``; the whole-run figure (``productive / wall time``) stands beside it.
It is the goodput the benchmarks report (``benchmarks/peers.py``: steps gained
x fault-free step time / window from the first completed step).
"""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.observe.records import RecoveryRecord
from orchestrator.state.records import TrainingTime

__all__ = [
    "PARTS",
    "PART_LABELS",
    "TrainingTime",
    "effective_summary",
    "effective_text",
    "seconds_text",
    "time_parts",
    "time_rows",
    "training_time",
]


def _inside(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` that any of ``intervals`` covers (overlaps counted once)."""
    covered, reach = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            covered += b - a
            reach = b
    return covered


def training_time(
    *,
    submitted_at: float,
    train_started_at: float | None,
    last_step_at: float | None,
    end: float,
    steps: int,
    recoveries: Iterable[RecoveryRecord],
    checkpoint_stall_s: float = 0.0,
    failing_since: float | None = None,
) -> TrainingTime:
    """Split a run's wall time (see the module docstring).

    Args:
        submitted_at: when the run was submitted (its wall time starts here).
        train_started_at: when its first step completed (None: not yet).
        last_step_at: when its latest step completed.
        end: the end of the wall time (the run's end, or now while it runs).
        steps: steps gained from the first completed step to the latest.
        recoveries: the run's recoveries (those before the first step are start-up).
        checkpoint_stall_s: seconds saves blocked the training loop between the first
            and the latest step.
        failing_since: when a failure still being recovered from began, if any.
    """
    wall = max(0.0, end - submitted_at)
    if train_started_at is None:
        return TrainingTime(wall_s=wall, startup_s=wall)
    first = min(max(train_started_at, submitted_at), submitted_at + wall)
    stop = submitted_at + wall
    last = min(max(last_step_at if last_step_at is not None else first, first), stop)
    startup = first - submitted_at
    since = stop - first
    intervals = [(r.failure_at, r.first_step_at) for r in recoveries if r.failure_at >= first]
    rerun = sum(r.steps_rerun for r in recoveries if r.failure_at >= first)
    if failing_since is not None and failing_since >= first:
        intervals.append((failing_since, stop))
    in_span = _inside(intervals, first, last)
    recovering = in_span + _inside(intervals, last, stop)
    stepping = (last - first) - in_span
    stalls = min(max(0.0, checkpoint_stall_s), stepping)
    trained = max(0, steps) + rerun
    step_s = (stepping - stalls) / trained if trained > 0 else 0.0
    productive = max(0, steps) * step_s
    rerun_s = rerun * step_s
    failures = recovering + rerun_s
    other = max(0.0, since - productive - failures - stalls)
    return TrainingTime(
        wall_s=wall,
        startup_s=startup,
        since_first_step_s=since,
        productive_s=productive,
        failures_s=failures,
        recovering_s=recovering,
        rerun_s=rerun_s,
        checkpoint_s=stalls,
        other_s=other,
        effective=productive / since if since > 0 else 0.0,
        whole_run=productive / wall if wall > 0 else 0.0,
        step_s=step_s,
    )


#: The parts of a run's wall time, in the order they are shown (they add up to it).
PARTS = ("startup", "productive", "failures", "checkpoint", "other")
#: Each part's line for people.
PART_LABELS = {
    "startup": "start-up",
    "productive": "productive",
    "failures": "lost to failures",
    "checkpoint": "checkpoint stalls",
    "other": "other",
}


def time_parts(split: TrainingTime) -> dict[str, float]:
    """The parts of ``split`` that add up to its wall time, by :data:`PARTS` name."""
    return {
        "startup": split.startup_s,
        "productive": split.productive_s,
        "failures": split.failures_s,
        "checkpoint": split.checkpoint_s,
        "other": split.other_s,
    }


def seconds_text(seconds: float) -> str:
    """``0.35s``, ``15.2s``, ``1234s``: two significant decimals where they matter."""
    if seconds < 10:
        return f"{seconds:.2f}s"
    return f"{seconds:.1f}s" if seconds < 1000 else f"{seconds:.0f}s"


def effective_text(split: TrainingTime) -> str:
    """``97.1% since the first step (64.4% of the whole run)``."""
    return f"{split.effective:.1%} since the first step ({split.whole_run:.1%} of the whole run)"


def time_rows(split: TrainingTime) -> list[tuple[str, str]]:
    """Where the wall time went, one ``(line, value)`` per part, for people.

    The same lines in ``ringmaster status``, the table ``ringmaster run`` ends
    with and the report: start-up, productive, lost to failures, checkpoint
    stalls, other, then effective training.
    """
    failures = seconds_text(split.failures_s)
    if split.failures_s > 0:
        failures += (
            f" (recovering {seconds_text(split.recovering_s)}, "
            f"steps re-run {seconds_text(split.rerun_s)})"
        )
    shown = {
        "startup": f"{seconds_text(split.startup_s)} (submission to the first step)",
        "productive": seconds_text(split.productive_s),
        "failures": failures,
        "checkpoint": seconds_text(split.checkpoint_s),
        "other": f"{seconds_text(split.other_s)} (mostly after the latest step)",
    }
    return [
        *((PART_LABELS[part], shown[part]) for part in PARTS),
        (
            "effective training",
            f"{effective_text(split)}: {seconds_text(split.productive_s)} of "
            f"{seconds_text(split.since_first_step_s)} ({seconds_text(split.wall_s)} in all)",
        ),
    ]


def effective_summary(split: TrainingTime) -> str:
    """One line: effective training beside the start-up, failures and checkpoint stalls."""
    return (
        f"effective training {effective_text(split)}; start-up {seconds_text(split.startup_s)}, "
        f"failures {seconds_text(split.failures_s)}, "
        f"checkpoint stalls {seconds_text(split.checkpoint_s)}"
    )
