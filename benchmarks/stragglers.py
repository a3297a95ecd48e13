"""Stragglers: a node of a real training job slowed from outside, called and swapped.

Every row runs real jobs with ``LocalRun`` on this machine (a private etcd, a
controller, node agents and their workers on gloo).  The headline rows run the
flagship LM (``examples/train_lm.py``) with the job file's defaults for
``fault_tolerance`` (``stragglers``: threshold 1.2, 5 windows, ``min_gain``
10 s, ``confirm`` 5 s; ``heartbeat_interval`` 2 s), but ``stragglers.action:
swap`` (the default is ``report``: it never swaps).  The output says which
settings each row used.

Headline rows (the default ``--rows``):

* ``ddp-1.5x``, ``ddp-3x``: the LM under DDP, 3 active nodes of 1 worker and 1
  warm spare.  Once the job has trained ``--warm-steps`` steps, it trains
  healthy for ``--healthy-seconds``: its step rate then is the row's healthy
  reference (the same job, in the same run).  Then one active node is slowed
  from outside (``--slowdown``): by default each step of its workers first
  stalls for ``k - 1`` times what its steps take (a sleep: the host waiting on
  a slow device; ``work``: as much CPU spun; ``stop``: its workers SIGSTOPped
  a share of every 100 ms; ``benchmarks/_noisy_worker.py``).  What is applied
  is not what the node gets on cores shared by every node, so ``k`` is held to
  the measured factor (``benchmarks/_straggler_slowdown.py``): from the onset,
  each window of the workers' heartbeats gives the slow node's compute time
  per step over the median of its peers', measured as the controller measures
  it, and ``k`` is adjusted until that is the nominal factor (it starts at the
  nominal factor in a row's first run and where the last run ended in the
  next; ``--no-calibration`` keeps it at the nominal factor and only
  measures).  Reported per run: the nominal factor; the measured one (the slow
  node's compute time per step over its peers' median, over every step from
  the onset to the call) and the same over the healthy reference (about 1);
  the slow node's and its peers' compute per step then over their healthy one;
  the last ``k`` applied; seconds from the onset until a window first measured
  95 % of the factor; seconds from the onset to that node's ``Straggler``
  event (the targets are judged on this one: the clock starts before the
  factor is reached) and from the factor reached to it (negative: called
  before a window measured it whole); to its ``StragglerSwapped`` one; the
  step rate between the onset and the swap and from the swap to the end, over
  the healthy rate; seconds from the swap until a ``--rate-window`` window
  runs at 95 % of the healthy rate again (its end); steps lost (applied twice
  by a worker, or never, from every worker's step log); calls and swaps of any
  other node.  The job stops ``--after-seconds`` after the swap (``max_steps``
  is ``--max-steps``: a long job, so that a swap pays);
* ``fsdp-1.5x``, ``fsdp-3x``: the same with the LM sharded by FSDP2
  (``examples/train_lm_mesh.py --mesh shard=2``: 2 active nodes of 2 workers,
  each node one replica sharded over its 2 workers, HSDP; 1 spare node), timed
  from FSDP2's collectives; the spare takes the slow node's slices from their
  twins;
* ``noise``, ``noise-beside``: the false-swap rows.  The LM under DDP as above,
  healthy, for ``--noise-minutes``, with noise on ONE node only: a CPU hog
  beside its worker in bursts of random length (``benchmarks/_cpu_hog.py``:
  0.5 to 4 s, 2 to 30 s apart, 1 or 2 hogs sharing one core with the node's
  processes) and a garbage-collection pause storm inside its worker
  (``benchmarks/_noisy_worker.py``: 20 to 300 ms pauses, one every 2 s on
  average), both seeded (``--seed``).  ``noise-beside`` runs a second job (the
  LM, 2 nodes, steps not timed) beside it on the same cores.  Counted:
  ``Straggler`` calls (of the noisy node and of others), ``StragglerSwapped``
  swaps, the hog's bursts and the pauses.

Each slow row runs ``--repeats`` times (default 3) and gives, per figure, the
median and the least and most of the runs.

Extra rows (only when named in ``--rows``), each named for what differs:

* ``fast-settings-1.5x``, ``fast-settings-3x``: the DDP rows with the
  benchmark's former settings (1 s windows, 3 of them, ``min_gain: 0s``);
* ``cost``: what timing the steps costs inside one worker process
  (``benchmarks/step_timing_cost.py``): nanoseconds per clock read, and a real
  DDP step with and without it, in percent of a 50 ms step;
* ``overhead``: 3 nodes of a busy-loop step (``--compute`` s of CPU a step,
  ``--heartbeat`` windows), ``action: off`` against ``report``, in
  ``--overhead-pairs`` pairs of short runs in alternating order;
* ``side_by_side``: the same two jobs at the same time on the same cores;
* ``link`` (``benchmarks/_slow_link_row.py``, needs root): the busy-loop job,
  one node's NIC limited to ``--link-rate`` with ``tc``, 1 s windows.

The last line is one JSON object of every figure, with their units.
``--smoke``: every row but ``fast-settings`` (the DDP rows' code with other
settings) with the LM's short form, half-second windows, 2 of them and no
``confirm``, a few seconds each, one repeat, the slow rows at 3x only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._cpu_hog import HogBursts  # noqa: E402
from benchmarks._slow_link_row import link_row  # noqa: E402
from benchmarks._smoke import parse, result_line  # noqa: E402
from benchmarks._straggler_jobs import (  # noqa: E402
    DEFAULTS,
    FAST,
    Settings,
    job,
    lm_job,
    rate,
    step_times,
)
from benchmarks._straggler_jobs import SMOKE as SMOKE_SETTINGS  # noqa: E402
from benchmarks._straggler_slowdown import HeldSlowdown  # noqa: E402
from benchmarks.step_timing_cost import SMOKE as COST_SMOKE  # noqa: E402
from benchmarks.step_timing_cost import call_costs, ddp_cost  # noqa: E402
from orchestrator.local_run import LocalRun  # noqa: E402
from orchestrator.spec.job import JobSpec, StragglerAction  # noqa: E402
from orchestrator.state import events, jobs, keys, records  # noqa: E402
from orchestrator.state.records import NodeRecord, Plan  # noqa: E402
from tests.faults.duty_cycle import DutyCycle, stopped_share  # noqa: E402

HEADLINE = ["ddp-1.5x", "ddp-3x", "fsdp-1.5x", "fsdp-3x", "noise", "noise-beside"]
SLOW_ROW = re.compile(r"^(ddp|fsdp|fast-settings)-([0-9.]+)x$")
#: the targets (issue figures): seconds to the call by slowdown, to 95 % after the swap
CALL_TARGET_S = {1.5: 30.0, 3.0: 15.0}
BACK_TARGET_S = 30.0
#: a run's slow node was at its nominal factor when measured within this (percent)
FACTOR_TOLERANCE_PCT = 10.0

#: ``--smoke``: short jobs, short windows, one repeat, every row's code path.
SMOKE = {
    "warm_steps": 5,
    "healthy_seconds": 2.0,
    "after_seconds": 2.0,
    "give_up_seconds": 20.0,
    "rate_window": 1.0,
    "repeats": 1,
    "noise_minutes": 0.1,
    "compute": 0.02,
    "steps": 150,
    "onset": 15,
    "heartbeat": "500ms",
    "overhead_pairs": 1,
    "overhead_steps": 30,
    "link_width": 32,
    "rows": ["cost", "ddp-3x", "fsdp-3x", "noise-beside", "side_by_side", "overhead", "link"],
}


def ended(local: LocalRun) -> bool:
    """Whether the job has ended (no straggler can be called or swapped after that)."""
    status = jobs.read_status(local.client, local.spec.name)
    return status is not None and status.phase.terminal


def run(spec: JobSpec, tmp: Path, during: Callable[[LocalRun], None] | None = None) -> Any:
    """Run ``spec`` to its end; ``during(run)`` runs once it started (in this thread)."""
    lines: list[str] = []
    local = LocalRun(
        spec,
        printer=lines.append,
        workdir=str(tmp),
        metrics_port=None,
        timeout=timedelta(minutes=30),
    )
    with local:
        if during is not None:
            during(local)
        result = local.wait()
    if result.phase.value not in ("Succeeded", "Stopped"):
        print("\n".join(lines[-40:]), file=sys.stderr)
    return result


def wait_step(local: LocalRun, step: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = jobs.read_status(local.client, local.spec.name)
        if status is not None and status.step >= step:
            return
        if status is not None and status.phase.terminal:
            raise RuntimeError(
                f"{local.spec.name} ended ({status.phase.value}: "
                f"{status.message}) before step {step}"
            )
        time.sleep(0.05)
    raise RuntimeError(f"{local.spec.name} did not reach step {step} in {timeout:g}s")


def wait_while(local: LocalRun, seconds: float) -> None:
    """Sleep ``seconds``, or less when the job ends first."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not ended(local):
        time.sleep(min(0.5, max(end - time.monotonic(), 0.0)))


def last_member(local: LocalRun) -> tuple[str, list[int]]:
    """The plan's last active node and its workers' process ids."""
    plan = records.read(local.client, keys.job_plan(local.spec.name), Plan)
    assert plan is not None
    name = plan.members[-1].node
    node = records.read(local.client, keys.job_node(local.spec.name, name), NodeRecord)
    assert node is not None and node.worker_pids, node
    return name, node.worker_pids


def say(path: Path, text: str) -> None:
    """Write ``path`` whole (a rename): a worker never reads it half written."""
    part = path.with_suffix(".part")
    part.write_text(text)
    part.replace(path)


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median, least and most of the runs' values (None: a run without the figure)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "missing": len(values)}
    out: dict[str, Any] = {
        "median": round(statistics.median(got), 3),
        "min": round(min(got), 3),
        "max": round(max(got), 3),
    }
    if len(got) < len(values):
        out["missing"] = len(values) - len(got)
    return out


# --------------------------------------------------------------------------- slow rows


def slowed_run(
    args: argparse.Namespace,
    tmp: Path,
    sharded: bool,
    factor: float,
    settings: Settings,
    initial: float | None = None,
) -> dict[str, Any]:
    """One run of a slow row: healthy reference, onset, call, swap, recovery
    (``initial``: the stretch applied at the onset, before it is adjusted)."""
    name = tmp.name.replace(".", "-")
    slow_file = tmp / "slow"
    spec = lm_job(
        name,
        tmp,
        sharded=sharded,
        settings=settings,
        action=StragglerAction.SWAP,
        steps=args.max_steps,
        short=args.smoke,
        slow=slow_file,
    )
    marks: dict[str, float] = {}
    others: dict[float, str] = {}  # calls of another node, by event time
    other_swaps: set[float] = set()  # swaps of another node, by event time
    held: list[HeldSlowdown] = []  # the slow node, once slowed

    def slow_one(local: LocalRun) -> None:
        wait_step(local, args.warm_steps)
        victim, pids = last_member(local)
        plan = records.read(local.client, keys.job_plan(spec.name), Plan)
        assert plan is not None
        cycle = DutyCycle(pids, stopped=0.0)

        def apply(k: float) -> None:
            if args.slowdown == "stop":
                cycle.stopped = min(cycle.period * stopped_share(k), 0.95 * cycle.period)
            else:
                say(slow_file, f"{victim} {k} {args.slowdown}")

        slowed = HeldSlowdown(
            local.client,
            spec.name,
            victim,
            factor,
            apply,
            calibrate=not args.no_calibration,
            interval=spec.fault_tolerance.heartbeat_interval.total_seconds(),
            initial=initial,
        )
        held.append(slowed)
        marks["healthy"] = time.time()
        slowed.watch(plan)  # the healthy windows: the reference of the node's compute
        healthy_end = time.monotonic() + args.healthy_seconds
        while time.monotonic() < healthy_end and not ended(local):
            slowed.poll()
            time.sleep(0.1)
        marks["onset"] = time.time()
        slowed.start()
        if args.slowdown == "stop":
            cycle.start()
        deadline = time.monotonic() + args.give_up_seconds
        try:
            while time.monotonic() < deadline and "swap" not in marks and not ended(local):
                for e in events.list_events(local.client, spec.name):
                    node = e.data.get("node")
                    if e.type == "Straggler" and node == victim:
                        marks.setdefault("call", e.time)
                    elif e.type == "Straggler":
                        others[e.time] = f"{node} at {e.time - marks['onset']:.1f}s"
                    if e.type == "StragglerSwapped" and node == victim:
                        marks["swap"] = e.time
                    elif e.type == "StragglerSwapped":
                        other_swaps.add(e.time)
                if "swap" not in marks:
                    slowed.poll()
                time.sleep(0.1)
        finally:
            slowed.stop()
            cycle.done.set()
        wait_while(local, args.after_seconds)
        with contextlib.suppress(Exception):
            jobs.request_stop(local.client, spec.name)

    result = run(spec, tmp, slow_one)
    done, lost = step_times(tmp)
    onset, end = marks["onset"], max(done.values())
    healthy = rate(done, marks["healthy"], onset)
    swap = marks.get("swap")
    during = rate(done, onset, swap or end)
    after = rate(done, swap, end) if swap else None
    back = None
    t = swap
    while swap is not None and t is not None and t + args.rate_window <= end:
        r = rate(done, t, t + args.rate_window)
        if healthy and r is not None and r >= 0.95 * healthy:
            back = t + args.rate_window - swap
            break
        t += 0.25
    call = marks.get("call")
    slowed = held[0]
    factor_at = slowed.reached_at
    # compute per step, the slow node's and its peers' median: healthy, and from the
    # onset to the call (what the controller judged; to the swap or the end without one)
    before = slowed.factor_between(marks["healthy"], onset)
    while_slow = slowed.factor_between(onset, call or swap or end)
    node_ratio = peers_ratio = None  # compute per step while slowed / healthy
    if before is not None and while_slow is not None:
        node_ratio, peers_ratio = while_slow[0] / before[0], while_slow[1] / before[1]
    out = {
        "phase": result.phase.value,
        "healthy_steps_per_s": round(healthy, 3) if healthy else None,
        "nominal_factor": factor,
        "measured_factor": _round(while_slow[0] / while_slow[1] if while_slow else None, 3),
        "healthy_factor": _round(before[0] / before[1] if before else None, 3),
        "node_compute_ratio": _round(node_ratio, 3),
        "peers_compute_ratio": _round(peers_ratio, 3),
        "applied_factor": slowed.applied,
        "factor_reached_s": _round(factor_at - onset if factor_at else None, 2),
        "call_s": _round(call - onset if call else None, 2),
        "call_after_factor_s": _round(call - factor_at if call and factor_at else None, 2),
        "swap_s": _round(swap - onset if swap else None, 2),
        "during_ratio": _round(during / healthy if during and healthy else None, 3),
        "after_ratio": _round(after / healthy if after and healthy else None, 3),
        "back_to_95pct_after_swap_s": _round(back, 2),
        "steps_lost": lost,
        "other_calls": len(others),
        "other_swaps": len(other_swaps),
    }
    trace = ", ".join(
        f"{w.start - onset:+.1f}..{w.at - onset:+.1f}s {w.factor:.2f}x "
        f"({w.slow.compute_s * 1e3:.0f}/"
        f"{statistics.median(t.compute_s for t in w.peers.values()) * 1e3:.0f} ms, "
        f"applied {w.applied:g})"
        for w in slowed.windows
    )
    print(
        f"  {tmp.name}: {out}\n    windows: {trace}"
        + (f"\n    other calls: {list(others.values())}" if others else ""),
        flush=True,
    )
    return out


def _round(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None


def slow_row(args: argparse.Namespace, root: Path, row: str) -> dict[str, Any]:
    match = SLOW_ROW.match(row)
    assert match is not None
    kind, factor = match.group(1), float(match.group(2))
    settings = SMOKE_SETTINGS if args.smoke else FAST if kind == "fast-settings" else DEFAULTS
    sharded = kind == "fsdp"
    job_text = (
        "LM, FSDP2 (HSDP: 2 nodes x 2 workers, sharded within a node), 1 spare"
        if sharded
        else "LM, DDP, 3 nodes x 1 worker, 1 spare"
    )
    said = settings.describe(StragglerAction.SWAP)
    print(f"{row}: {job_text}; {said}", flush=True)
    runs: list[dict[str, Any]] = []
    for i in range(args.repeats):  # each run starts with the stretch the last ended with
        initial = runs[-1]["applied_factor"] if runs else None
        runs.append(slowed_run(args, root / f"{row}-{i}", sharded, factor, settings, initial))
    keys_ = [k for k in runs[0] if k != "phase"]
    out: dict[str, Any] = {
        "job": job_text,
        "settings": said,
        "runs": len(runs),
        "phases": [r["phase"] for r in runs],
    }
    for k in keys_:
        out[k] = spread([r[k] for r in runs])
    call_target = CALL_TARGET_S.get(factor)
    calls, backs = [r["call_s"] for r in runs], [r["back_to_95pct_after_swap_s"] for r in runs]
    called = [c is not None and call_target is not None and c <= call_target for c in calls]
    out["targets"] = {
        "factor_within_pct": FACTOR_TOLERANCE_PCT,
        "factor_met": all(
            r["measured_factor"] is not None
            and abs(r["measured_factor"] / factor - 1.0) * 100.0 <= FACTOR_TOLERANCE_PCT
            for r in runs
        ),
        "call_within_s": call_target,
        "call_met": all(called),
        "swapped_every_run": all(r["swap_s"] is not None for r in runs),
        "back_within_s": BACK_TARGET_S,
        "back_met": all(b is not None and b <= BACK_TARGET_S for b in backs),
        "no_step_lost": all(r["steps_lost"] == 0 for r in runs),
    }
    print(f"{row}: {out}", flush=True)
    return out


# --------------------------------------------------------------------------- noise rows


def noise_row(args: argparse.Namespace, root: Path, beside: bool) -> dict[str, Any]:
    """Per-node noise on a healthy job at the defaults for ``--noise-minutes``."""
    tag = "noise-beside" if beside else "noise"
    tmp = root / tag
    trigger = tmp / "gc-storm"
    settings = SMOKE_SETTINGS if args.smoke else DEFAULTS
    spec = lm_job(
        tag,
        tmp,
        sharded=False,
        settings=settings,
        action=StragglerAction.SWAP,
        steps=args.max_steps,
        short=args.smoke,
        gc_storm=trigger,
    )
    said = settings.describe(StragglerAction.SWAP)
    print(
        f"{tag}: LM, DDP, 3 nodes x 1 worker, 1 spare"
        + (", a second LM job of 2 nodes beside it" if beside else "")
        + f"; {said}",
        flush=True,
    )
    seconds = 60.0 * args.noise_minutes
    loads: list[float] = []
    noise: dict[str, Any] = {}

    def noisy(local: LocalRun) -> None:
        wait_step(local, args.warm_steps)
        node, pids = last_member(local)
        noise["node"] = node
        say(trigger, f"{node} {args.seed}")
        hog = HogBursts(pids, args.seed, smoke=args.smoke)
        hog.start()
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end and not ended(local):
                loads.append(os.getloadavg()[0])
                time.sleep(min(10.0, max(end - time.monotonic(), 0.0)))
        finally:
            hog.done.set()
            hog.join()
        noise.update(hog_bursts=hog.bursts, hog_seconds=round(hog.seconds, 1))
        jobs.request_stop(local.client, spec.name)

    second = None
    if beside:
        other_dir = root / f"{tag}-second"
        other = lm_job(
            f"{tag}-second",
            other_dir,
            sharded=False,
            settings=DEFAULTS,
            action=StragglerAction.OFF,
            steps=args.max_steps,
            short=args.smoke,
            nodes=2,
            spares=0,
        )
        second = LocalRun(
            other, printer=lambda line: None, workdir=str(other_dir), metrics_port=None
        )
    with second if second is not None else contextlib.nullcontext():
        result = run(spec, tmp, noisy)
        if second is not None:
            jobs.request_stop(second.client, second.spec.name)
            second.wait()
    evs = result.events
    calls = [e for e in evs if e.type == "Straggler"]
    swaps = [e for e in evs if e.type == "StragglerSwapped"]
    pauses = trigger.with_suffix(".pauses")
    paused = [float(x) for x in pauses.read_text().split()] if pauses.exists() else []
    _, lost = step_times(tmp)
    out = {
        "settings": said,
        "seconds": round(seconds, 1),
        "noisy_node": noise.get("node"),
        "hog_bursts": noise.get("hog_bursts"),
        "hog_seconds": noise.get("hog_seconds"),
        "gc_pauses": len(paused),
        "gc_pause_seconds": round(sum(paused), 1),
        "calls_noisy_node": sum(1 for e in calls if e.data.get("node") == noise.get("node")),
        "calls_other_nodes": sum(1 for e in calls if e.data.get("node") != noise.get("node")),
        "false_swaps": len(swaps),
        "steps_lost": lost,
        "load_min": round(min(loads), 2) if loads else None,
        "load_median": round(statistics.median(loads), 2) if loads else None,
        "load_max": round(max(loads), 2) if loads else None,
    }
    start = min((e.time for e in evs), default=0.0)
    said_evs = [
        e
        for e in evs
        if e.type in ("Straggler", "StragglerCleared", "StragglerSwapped", "StragglerKept")
    ]
    print(
        f"{tag}: {out}"
        + "".join(f"\n  {e.time - start:7.1f}s {e.type}: {e.message}" for e in said_evs),
        flush=True,
    )
    return out


# --------------------------------------------------------------------------- extra rows


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
            spec = job(name, tmp, args, nodes=3, spares=0, action=action, steps=args.overhead_steps)
            run(spec, tmp)
            done, _ = step_times(tmp)
            first, last = done[min(done) + 10], done[max(done)]  # past the warm-up
            r = rate(done, first, last)
            assert r is not None
            pair[action.value] = r
            rates[action.value].append(r)
        ratios.append(pair["report"] / pair["off"])
        print(
            f"overhead pair {i}: off {pair['off']:.2f}, report {pair['report']:.2f} steps/s, "
            f"ratio {ratios[-1]:.4f}",
            flush=True,
        )
    return {
        "job": f"busy loop of {args.compute:g} s CPU a step, 3 nodes, heartbeat {args.heartbeat}",
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
            specs.append(
                job(
                    name,
                    dirs[-1],
                    args,
                    nodes=3,
                    spares=0,
                    action=action,
                    steps=args.overhead_steps,
                )
            )
        runs = [
            LocalRun(spec, printer=lambda line: None, workdir=str(d), metrics_port=None)
            for spec, d in zip(specs, dirs, strict=True)
        ]
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
        print(
            f"side by side {i}: off {off:.2f}, report {report:.2f} steps/s over "
            f"{end - start:.0f} s, ratio {ratios[-1]:.4f}",
            flush=True,
        )
    if not ratios:
        return {"pairs": 0}
    return {
        "pairs": len(ratios),
        "overhead_pct": round(100.0 * (1.0 - statistics.median(ratios)), 2),
        "overhead_pct_min": round(100.0 * (1.0 - max(ratios)), 2),
        "overhead_pct_max": round(100.0 * (1.0 - min(ratios)), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rows",
        nargs="*",
        default=["cost", *HEADLINE],
        help="rows to run: " + ", ".join(HEADLINE) + "; extra: "
        "fast-settings-1.5x, fast-settings-3x, overhead, side_by_side, "
        "link (any ddp-/fsdp-/fast-settings-<factor>x)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each slow row")
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=20,
        help="steps trained before the healthy reference starts",
    )
    parser.add_argument(
        "--healthy-seconds",
        type=float,
        default=30.0,
        help="healthy training before the onset: the reference rate",
    )
    parser.add_argument(
        "--after-seconds",
        type=float,
        default=45.0,
        help="training after the swap before the job is stopped",
    )
    parser.add_argument(
        "--give-up-seconds",
        type=float,
        default=150.0,
        help="no swap this long after the onset: the run goes on",
    )
    parser.add_argument(
        "--rate-window",
        type=float,
        default=5.0,
        help="seconds of the windows the recovery's rate is read over",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=1_000_000,
        help="the LM jobs' max_steps (a long job: stopped by the row)",
    )
    parser.add_argument(
        "--slowdown",
        choices=["stall", "work", "stop"],
        default="stall",
        help="stall: the slow node's steps wait (sleep) FACTOR - 1 times what "
        "they took; work: they spin that much more CPU; stop: its workers "
        "SIGSTOPped 1 - 1/FACTOR of every 100 ms",
    )
    parser.add_argument(
        "--no-calibration",
        action="store_true",
        help="apply the nominal factor as it is (the slow node's measured "
        "factor is still reported); by default what is applied is adjusted "
        "until the measured factor is the nominal one",
    )
    parser.add_argument("--noise-minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1, help="the noise rows' bursts and pauses")
    parser.add_argument(
        "--compute",
        type=float,
        default=0.05,
        help="extra rows' busy-loop job: CPU seconds per step",
    )
    parser.add_argument("--steps", type=int, default=400, help="the link row's steps")
    parser.add_argument("--onset", type=int, default=80, help="the link row's onset step")
    parser.add_argument("--heartbeat", default="1s", help="extra rows' heartbeat_interval")
    parser.add_argument("--overhead-pairs", type=int, default=6, help="pairs of off/report runs")
    parser.add_argument("--overhead-steps", type=int, default=250, help="steps of each such run")
    parser.add_argument("--link-rate", default="100mbit", help="the link row's tbf rate")
    parser.add_argument(
        "--link-width", type=int, default=512, help="the link row's model: width x width parameters"
    )
    args = parse(parser, SMOKE)
    for row in args.rows:
        known = {"cost", "overhead", "side_by_side", "link", *HEADLINE}
        if row not in known and not SLOW_ROW.match(row):
            parser.error(
                f"--rows: unknown row {row!r}; rows: {', '.join(sorted(known))} "
                f"or ddp-/fsdp-/fast-settings-<factor>x, e.g. ddp-2x"
            )
    figures: dict[str, Any] = {
        "machine_cores": os.cpu_count(),
        "settings_note": "headline rows: the job file's defaults but stragglers.action swap "
        "(the default action is report); extra rows name their settings",
    }
    with tempfile.TemporaryDirectory(prefix="ringmaster-stragglers-") as d:
        root = Path(d)
        for row in args.rows:
            started = time.monotonic()
            if row == "cost":
                if args.smoke:
                    calls = call_costs(COST_SMOKE["number"])
                    ddp = ddp_cost(block=COST_SMOKE["block"], pairs=COST_SMOKE["pairs"])
                else:
                    calls, ddp = call_costs(), ddp_cost()
                figures["cost"] = {"calls": calls, "ddp": ddp}
                print(f"cost: {figures['cost']}", flush=True)
            elif SLOW_ROW.match(row):
                figures[row] = slow_row(args, root, row)
            elif row in ("noise", "noise-beside"):
                figures[row] = noise_row(args, root, beside=row == "noise-beside")
            elif row == "overhead":
                figures["overhead"] = overhead_rows(args, root)
            elif row == "side_by_side":
                figures["side_by_side"] = side_by_side_rows(args, root)
            elif row == "link":
                figures["slow_link"] = link_row(args, root)
            print(f"({row}: {time.monotonic() - started:.0f} s)", flush=True)
    figures["units"] = {
        "*_s": "seconds (call_s, swap_s: from the onset; back_to_95pct_after_swap_s: from "
        "the swap to the end of the first window at 95 % of the healthy rate)",
        "*_ratio": "step rate / the same run's healthy step rate",
        "*_factor": "the slow node's compute time per step / the median of its peers' "
        "(applied_factor: the stretch k applied last, see --slowdown)",
        "healthy_steps_per_s": "steps per second",
        "median/min/max": "over the row's repeats",
        "overhead_pct": "percent of the step rate",
        "load_*": "1-minute load average",
    }
    print(result_line(figures, args.smoke))


if __name__ == "__main__":
    main()
