"""Stragglers: a node slowed from outside, detected and swapped for a warm spare.

Every row runs a real job with ``LocalRun`` on this machine (a private etcd,
a controller, node agents and their workers on gloo).  The training step is
compute bound: each worker spins for ``--compute`` seconds of CPU time per
step (a forward and backward pass would), then all-reduces its gradients.
A node is slowed from outside, as a throttled machine would be: its workers
are SIGSTOPped for a share of every 100 ms (1 - 1/factor: at 1.5x they run
two thirds of the time).

Rows, all in this run:

* ``cost``: what timing the steps costs inside one worker process
  (``benchmarks/step_timing_cost.py``): nanoseconds per clock read, and a
  real DDP step with and without it, in percent of a 50 ms step;
* ``overhead``: 3 nodes, no slowdown, ``fault_tolerance.stragglers.action``
  ``off`` (steps not timed) against ``report`` (timed and judged):
  ``--overhead-pairs`` pairs of short runs in alternating order (off first,
  then report first, ...); the median step rate of each, and the median,
  least and most of the pairs' differences, in percent.  On a shared machine
  the spread is wider than the cost: ``cost`` is what bounds it;
* ``side_by_side`` (only when named in ``--rows``): the same two jobs at the
  same time on the same cores, ``--overhead-pairs`` times; the median, least
  and most of the differences of their step rates over the time both
  trained;
* ``slow_1.5x`` and ``slow_3x`` (the ``slow`` of ``--rows``): 3 active nodes and 1 warm spare with
  ``action: swap``; at step ``--onset`` one active node is slowed.  Seconds
  from the onset to the ``Straggler`` event and to the ``StragglerSwapped``
  one; the step rate before the onset, between the onset and the swap, and
  from 2 s after the swap to the end, against the healthy rate of the
  ``overhead`` rows (``report``); seconds from the onset until a 5 s window
  runs at 95 % of the healthy rate again; steps lost (applied twice or never,
  from every worker's step log);
* ``healthy``: 3 active nodes and 1 spare with ``action: swap`` for
  ``--healthy-seconds`` with no slowdown, while a second job (2 nodes, same
  step) trains beside it on the same cores: the machine's own noise, and
  more.  False ``Straggler`` calls and false swaps are counted, and the
  machine's load average (least, median, most of a sample every 10 s) is
  given beside them: on a shared machine it says how much noise there was.

* ``slow_link`` (``link`` in ``--rows``; ``benchmarks/_slow_link_row.py``, needs root): 2 active
  nodes and 1 spare, one of them in a network namespace whose veth is
  limited to ``--link-rate`` at step ``--onset``; seconds to the link probe,
  the call and the swap, the step rate before, during and after.

The last line is one JSON object with every figure.  ``--smoke``: every default row
(``side_by_side`` too) with short jobs of 20 ms steps and half-second windows, one
overhead pair, the ``slow`` row at 3x only, 3 s of ``healthy``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._slow_link_row import link_row  # noqa: E402
from benchmarks._smoke import parse, result_line  # noqa: E402
from benchmarks._straggler_jobs import job, rate, step_times  # noqa: E402
from benchmarks.step_timing_cost import SMOKE as COST_SMOKE  # noqa: E402
from benchmarks.step_timing_cost import call_costs, ddp_cost  # noqa: E402
from orchestrator import events, jobs, keys, records  # noqa: E402
from orchestrator.local_run import LocalRun  # noqa: E402
from orchestrator.records import NodeRecord, Plan  # noqa: E402
from orchestrator.spec import JobSpec, StragglerAction  # noqa: E402
from tests.faults.duty_cycle import DutyCycle, stopped_share  # noqa: E402

#: ``--smoke``: short jobs, short windows, one pair, every row.
SMOKE = {
    "compute": 0.02,
    "steps": 150,
    "onset": 15,
    "healthy_seconds": 3.0,
    "heartbeat": "500ms",
    "overhead_pairs": 1,
    "overhead_steps": 30,
    "link_width": 32,
    "rows": ["cost", "side_by_side", "overhead", "slow", "link", "healthy"],
}


def ended(local: LocalRun) -> bool:
    """Whether the job has ended (no straggler can be called or swapped after that)."""
    status = jobs.read_status(local.client, local.spec.name)
    return status is not None and status.phase.terminal


def run(spec: JobSpec, tmp: Path, during: Any = None) -> tuple[Any, list[events.Event]]:
    """Run ``spec`` to its end; ``during(run)`` runs once the job trains (in this thread)."""
    lines: list[str] = []
    local = LocalRun(spec, printer=lines.append, workdir=str(tmp), metrics_port=None,
                     timeout=timedelta(minutes=20))  # fmt: skip
    with local:
        if during is not None:
            during(local)
        result = local.wait()
    if result.phase.value != "Succeeded" and not during:
        print("\n".join(lines[-40:]), file=sys.stderr)
    return result, result.events


def wait_step(local: LocalRun, step: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = jobs.read_status(local.client, local.spec.name)
        if status is not None and status.step >= step:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{local.spec.name} did not reach step {step} in {timeout:g}s")


def overhead_rows(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Pairs of short runs, ``off`` and ``report``, in alternating order (ABBA): the
    machine's drift over a pair cancels out of the pairs' median ratio."""
    rates: dict[str, list[float]] = {"off": [], "report": []}
    ratios: list[float] = []
    off_first = (StragglerAction.OFF, StragglerAction.REPORT)
    for i in range(args.overhead_pairs):
        pair: dict[str, float] = {}
        for action in off_first if i % 2 == 0 else off_first[::-1]:
            name = f"overhead-{i}-{action.value}"
            tmp = root / name
            spec = job(name, tmp, args, nodes=3, spares=0, action=action,
                       steps=args.overhead_steps)  # fmt: skip
            run(spec, tmp)
            done, _ = step_times(tmp)
            first, last = done[min(done) + 10], done[max(done)]  # past the warm-up
            r = rate(done, first, last)
            assert r is not None
            pair[action.value] = r
            rates[action.value].append(r)
        ratios.append(pair["report"] / pair["off"])
        print(f"overhead pair {i}: off {pair['off']:.2f}, report {pair['report']:.2f} steps/s, "
              f"ratio {ratios[-1]:.4f}", flush=True)  # fmt: skip
    return {
        "pairs": len(ratios),
        "steps_per_run": args.overhead_steps,
        "off_steps_per_s": round(statistics.median(rates["off"]), 3),
        "report_steps_per_s": round(statistics.median(rates["report"]), 3),
        "overhead_pct": round(100.0 * (1.0 - statistics.median(ratios)), 2),
        "overhead_pct_min": round(100.0 * (1.0 - max(ratios)), 2),
        "overhead_pct_max": round(100.0 * (1.0 - min(ratios)), 2),
    }


def side_by_side_rows(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The same pair of jobs, ``off`` and ``report``, run at the same time on the same
    cores, ``--overhead-pairs`` times: both see the same noise, so the ratio of their
    step rates over the time both trained is the closest to "the same run"."""
    ratios: list[float] = []
    for i in range(args.overhead_pairs):
        specs, dirs = [], []
        for action in (StragglerAction.OFF, StragglerAction.REPORT):
            name = f"side-{i}-{action.value}"
            dirs.append(root / name)
            specs.append(job(name, dirs[-1], args, nodes=3, spares=0, action=action,
                             steps=args.overhead_steps))  # fmt: skip
        runs = [LocalRun(spec, printer=lambda line: None, workdir=str(d), metrics_port=None)
                for spec, d in zip(specs, dirs, strict=True)]  # fmt: skip
        with runs[0], runs[1]:
            for local in runs:
                local.wait()
        done = [step_times(d)[0] for d in dirs]
        start = max(d[min(d) + 10] for d in done)  # both past their warm-up
        end = min(d[max(d)] for d in done)  # until the first ends
        off, report = (rate(d, start, end) for d in done)
        if off is None or report is None:
            continue
        ratios.append(report / off)
        print(f"side by side {i}: off {off:.2f}, report {report:.2f} steps/s over "
              f"{end - start:.0f} s, ratio {ratios[-1]:.4f}", flush=True)  # fmt: skip
    return {
        "pairs": len(ratios),
        "overhead_pct": round(100.0 * (1.0 - statistics.median(ratios)), 2),
        "overhead_pct_min": round(100.0 * (1.0 - max(ratios)), 2),
        "overhead_pct_max": round(100.0 * (1.0 - min(ratios)), 2),
    }


def slow_row(args: argparse.Namespace, root: Path, factor: float, healthy: float) -> dict[str, Any]:
    tmp = root / f"slow-{factor:g}x"
    spec = job(f"slow-{factor:g}x".replace(".", "-"), tmp, args, nodes=3, spares=1,
               action=StragglerAction.SWAP, steps=args.steps)  # fmt: skip
    marks: dict[str, float] = {}

    def slow_one(local: LocalRun) -> None:
        wait_step(local, args.onset)
        plan = records.read(local.client, keys.job_plan(spec.name), Plan)
        assert plan is not None
        victim = plan.members[-1].node
        node = records.read(local.client, keys.job_node(spec.name, victim), NodeRecord)
        assert node is not None
        cycle = DutyCycle(node.worker_pids, stopped=0.1 * stopped_share(factor))
        marks["onset"] = time.time()
        cycle.start()
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline and "swap" not in marks and not ended(local):
                for e in events.list_events(local.client, spec.name):
                    if e.type == "Straggler" and "detect" not in marks:
                        marks["detect"] = e.time
                    if e.type == "StragglerSwapped":
                        marks["swap"] = e.time
                time.sleep(0.1)
        finally:
            cycle.done.set()

    result, _ = run(spec, tmp, slow_one)
    done, lost = step_times(tmp)
    onset = marks["onset"]
    end = max(done.values())
    out: dict[str, Any] = {
        "phase": result.phase.value,
        "detect_s": round(marks["detect"] - onset, 2) if "detect" in marks else None,
        "swap_s": round(marks["swap"] - onset, 2) if "swap" in marks else None,
        "steps_lost": lost,
    }
    trained = sorted(done.values())[min(5, len(done) - 1)]  # past the first steps
    before = rate(done, max(onset - 10.0, trained), onset)
    swap = marks.get("swap", end)
    during = rate(done, onset, swap)
    after = rate(done, swap + 2.0, end)
    back = None
    t = onset
    while t + 5.0 <= end:
        r = rate(done, t, t + 5.0)
        if t > onset + 1.0 and r is not None and r >= 0.95 * healthy:
            back = round(t + 5.0 - onset, 2)
            break
        t += 0.5
    out.update(
        before_ratio=round(before / healthy, 3) if before else None,
        during_ratio=round(during / healthy, 3) if during else None,
        after_ratio=round(after / healthy, 3) if after else None,
        back_to_95pct_s=back,
    )
    print(f"slow {factor:g}x: {out}", flush=True)
    return out


def healthy_row(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    tmp, beside = root / "healthy", root / "beside"
    spec = job("healthy", tmp, args, nodes=3, spares=1, action=StragglerAction.SWAP,
               steps=10**9)  # fmt: skip
    other = job("beside", beside, args, nodes=2, spares=0, action=StragglerAction.OFF,
                steps=10**9)  # fmt: skip
    second = LocalRun(other, printer=lambda line: None, workdir=str(beside), metrics_port=None)

    loads: list[float] = []  # the machine's 1-minute load average, every 10 s

    def train_for_a_while(local: LocalRun) -> None:
        wait_step(local, 20)
        end = time.monotonic() + args.healthy_seconds  # the row's length: noise is measured
        while time.monotonic() < end:
            loads.append(os.getloadavg()[0])
            time.sleep(min(10.0, max(end - time.monotonic(), 0.0)))
        jobs.request_stop(local.client, spec.name)

    with second:
        _, evs = run(spec, tmp, train_for_a_while)
        jobs.request_stop(second.client, other.name)
        second.wait()
    calls = [e for e in evs if e.type == "Straggler"]
    swaps = [e for e in evs if e.type == "StragglerSwapped"]
    out = {"seconds": args.healthy_seconds, "false_calls": len(calls), "false_swaps": len(swaps),
           "load_min": round(min(loads), 2), "load_median": round(statistics.median(loads), 2),
           "load_max": round(max(loads), 2)}  # fmt: skip
    start = min((e.time for e in evs), default=0.0)
    said = [e for e in evs if e.type in ("Straggler", "StragglerCleared", "StragglerSwapped")]
    print(f"healthy: {out}" + "".join(f"\n  {e.time - start:7.1f}s {e.type}: {e.message}"
                                      for e in said), flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compute", type=float, default=0.05, help="CPU seconds per step")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--onset", type=int, default=80, help="step at which a node is slowed")
    parser.add_argument("--healthy-seconds", type=float, default=120.0)
    parser.add_argument("--heartbeat", default="1s", help="heartbeat_interval: one window")
    parser.add_argument("--overhead-pairs", type=int, default=6, help="pairs of off/report runs")
    parser.add_argument("--overhead-steps", type=int, default=250, help="steps of each such run")
    parser.add_argument("--link-rate", default="100mbit", help="the link row's tbf rate")
    parser.add_argument("--link-width", type=int, default=512,
                        help="the link row's model: width x width parameters")  # fmt: skip
    parser.add_argument("--rows", nargs="*",
                        default=["cost", "overhead", "slow", "link", "healthy"])  # fmt: skip
    args = parse(parser, SMOKE)
    figures: dict[str, Any] = {"machine_cores": os.cpu_count(), "compute_s": args.compute}
    with tempfile.TemporaryDirectory(prefix="ringmaster-stragglers-") as d:
        root = Path(d)
        healthy = None
        if "cost" in args.rows:
            if args.smoke:
                calls = call_costs(COST_SMOKE["number"])
                ddp = ddp_cost(block=COST_SMOKE["block"], pairs=COST_SMOKE["pairs"])
            else:
                calls, ddp = call_costs(), ddp_cost()
            figures["cost"] = {"calls": calls, "ddp": ddp}
            print(f"cost: {figures['cost']}", flush=True)
        if "side_by_side" in args.rows:
            figures["side_by_side"] = side_by_side_rows(args, root)
        if "overhead" in args.rows or "slow" in args.rows:
            figures["overhead"] = overhead_rows(args, root)
            healthy = figures["overhead"]["report_steps_per_s"]
        if "slow" in args.rows and healthy:
            for factor in (3.0,) if args.smoke else (1.5, 3.0):
                figures[f"slow_{factor:g}x"] = slow_row(args, root, factor, healthy)
        if "link" in args.rows:
            figures["slow_link"] = link_row(args, root)
        if "healthy" in args.rows:
            figures["healthy"] = healthy_row(args, root)
    figures["units"] = {"*_s": "seconds", "*_ratio": "step rate / healthy step rate",
                        "overhead_pct": "percent of the step rate"}  # fmt: skip
    print(result_line(figures, args.smoke))


if __name__ == "__main__":
    main()
