"""A recorded run's faults replayed through the simulator, beside what the run measured.

A :class:`~orchestrator.planning.api.RecordedRun` (read from a job's records in
etcd by :mod:`.from_run`, or from ``benchmarks/peers.py``'s output by
:mod:`.peers_records`) is simulated two ways, on its own fault times:

* :func:`replay`: each fault with the cost it had in the run (the seconds the
  job did not train, the steps it trained again), the run's checkpoint stalls
  and its end after the latest step.  What it predicts differs from what the
  run measured only where the simulator's accounts differ from the run's;
* :func:`model`: each fault with the recovery model's cost instead: a swap to
  a warm spare (the run's own warm recoveries, their median) and a replaced
  node that is a spare only once warm (``spare_warmup_s``).  Which failures
  find no warm spare, and how long they wait, comes out of the model.

:func:`effective` turns a simulated run into the measure the run reports
(productive time over the time since its first step).
"""

from __future__ import annotations

import statistics

from orchestrator.planning.api import (
    Cost,
    Fault,
    FaultKind,
    JobShape,
    RecordedRun,
    SimResult,
    TierModel,
)
from orchestrator.planning.simulator import simulate

__all__ = ["effective", "model", "replay", "spare_warmup_from", "warm_stop_from"]


def _shape(run: RecordedRun, spares: int) -> JobShape:
    train = run.window_s - run.tail_s - sum(_stop(run, i) for i in range(len(run.faults)))
    # the run's stalls as one block over its training time: the same share of it
    every = max(train - run.checkpoint_s, 1e-9)
    return JobShape(
        nodes=run.nodes,
        gpus_per_node=1,
        spares=spares,
        min_nodes=run.nodes,
        step_s=run.step_s,
        state_gb=0.0,
        checkpoint_every_s=every,
    )


def _stop(run: RecordedRun, i: int) -> float:
    """Seconds fault ``i`` kept the job from training (to the end: it never did again)."""
    f = run.faults[i]
    return run.window_s - run.tail_s - f.at if f.stop_s is None else f.stop_s


def _horizon(run: RecordedRun) -> float:
    return max(run.window_s - run.tail_s, 0.0)


def replay(run: RecordedRun) -> SimResult:
    """``run`` simulated with each fault's recorded cost (see the module docstring)."""
    job = _shape(run, spares=max(run.spares, len(run.faults)))
    tier = TierModel(
        run.tier,
        {FaultKind.CRASH: Cost(in_flight=run.in_flight)},
        checkpoint_block_s=run.checkpoint_s,
    )
    schedule = [
        Fault(
            f.at,
            FaultKind.CRASH,
            1,
            0.0,
            cost=Cost(
                detect_s=_stop(run, i),
                in_flight=run.in_flight,
                rework_s=f.rework_s,
                source=run.source,
            ),
        )
        for i, f in enumerate(run.faults)
    ]
    return simulate(job, tier, _horizon(run), schedule=schedule)


def model(run: RecordedRun, warm_stop_s: float, spare_warmup_s: float) -> SimResult:
    """``run``'s fault times with the model's costs: a swap to a warm spare takes
    ``warm_stop_s``; a killed node starts again at once and is a spare ``spare_warmup_s``
    later; a failure that finds no warm spare waits for the one starting."""
    job = _shape(run, spares=run.spares)
    tier = TierModel(
        run.tier,
        {FaultKind.CRASH: Cost(detect_s=warm_stop_s, in_flight=run.in_flight)},
        checkpoint_block_s=run.checkpoint_s,
        spare_warmup_s=spare_warmup_s,
    )
    schedule = [Fault(f.at, FaultKind.CRASH, 1, 0.0) for f in run.faults]
    return simulate(job, tier, _horizon(run), schedule=schedule)


def effective(run: RecordedRun, result: SimResult) -> float:
    """The simulated run's effective training as ``run`` measures it: the work done over
    the whole window (its end after the latest step trains nothing)."""
    if run.window_s <= 0:
        return 0.0
    return result.ettr * result.horizon_s / run.window_s


def warm_stop_from(runs: list[RecordedRun]) -> float | None:
    """The median stop of the faults that found a warm spare, over ``runs`` (of one tier;
    None: none did)."""
    stops = [
        f.stop_s
        for run in runs
        for f in run.faults
        if f.warm_spare and f.stop_s is not None and f.waited_s == 0
    ]
    return statistics.median(stops) if stops else None


def spare_warmup_from(runs: list[RecordedRun]) -> float | None:
    """Seconds from a replaced node's start to warm, as the runs show it: a failure that
    waited for the spare started at the fault before it found it warm that long after
    its start (the mean over such waits); None: no failure waited."""
    found = [
        run.faults[i].at - run.faults[i - 1].at + run.faults[i].waited_s
        for run in runs
        for i in range(1, len(run.faults))
        if run.faults[i].waited_s > 0
    ]
    return statistics.fmean(found) if found else None
