"""Goodput at scale, simulated: ETTR and GPU-hours lost per day, four ways to recover.

For 1,024, 16,384 and 100,000 GPUs (nodes of 8) under the ``llama3`` failure
preset (the Llama 3 405B run's 419 unexpected interruptions in 54 days on
16,384 GPUs, per root cause), the planner (:mod:`orchestrator.planning`)
simulates a month of one job under:

* torchrun: every worker restarts from the last checkpoint, checkpointing at
  the Young/Daly cadence, replacement nodes from a pool as large as the
  in-process tier's spares;
* torchft: replica groups of 8 nodes; a group with a failed node leaves and
  heals from a live group once the node is back; no spares;
* ringmaster's restart tier, with warm spares, at its Young/Daly cadence;
* ringmaster's in-process tier with the spares and cadence ``ringmaster plan``
  recommends.

Every recovery cost is labelled with its source (ringmaster's benchmarks, or
docs/peers.md for the peers); the assumptions are printed beside the numbers.

The replay of ``benchmarks/peers.py``'s goodput rows (``--skip-validate``
leaves it out): ``--peers-json FILE`` takes the JSON line a peers.py run ended
with (the file may hold its whole output) and replays each goodput row (2
nodes, 1 warm spare for ringmaster; a node SIGKILLed every ``period`` from
half a period after the first step) through the simulator two ways
(:mod:`orchestrator.planning.replay`): with each kill's own cost in that run
(``replay``), and, for the in-process tier, with the model's costs, a swap to a
warm spare and a replaced node that is a spare only once warm (``model``: the
run's warm swaps and spare warm-up, not each kill's time).  Each is printed
beside the effective training the run measured.  Without a file, the figures
typed in from docs/peers.md's quiet run (:data:`PEERS_MEASURED`) are replayed
instead, and labelled so.

``--from-run JOB --etcd HOST:PORT`` replays a job's own records the same way
(its recoveries and their costs, against its ``training_time``).

``--smoke``: the smallest configuration (1,024 GPUs, 2 days, one seed) through
every row's code path, in seconds.  The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.planning.api import (  # noqa: E402
    Cost,
    Fault,
    FaultKind,
    JobShape,
    RecordedRun,
    Tier,
    TierModel,
)
from orchestrator.planning.costs import Measured, recovery_model  # noqa: E402
from orchestrator.planning.peers_records import runs_from_peers  # noqa: E402
from orchestrator.planning.presets import PRESETS  # noqa: E402
from orchestrator.planning.recommend import mtbf_s, recommend, young_daly_s  # noqa: E402
from orchestrator.planning.replay import (  # noqa: E402
    effective,
    model,
    replay,
    spare_warmup_from,
    warm_stop_from,
)
from orchestrator.planning.simulator import simulate  # noqa: E402

GPUS_PER_NODE = 8
SIZES = (1024, 16_384, 100_000)
STEP_S = 2.0
STATE_GB = 10.0

#: The fallback when no --peers-json is given: typed in from docs/peers.md's quiet run
#: (the previous tree): effective training with a kill every 60 s / 15 s, and the
#: seconds from each kill to the next completed step in those runs.
PEERS_MEASURED: dict[str, dict[str, Any]] = {
    "ringmaster-in-process": {60: 0.991, 15: 0.963, "next_step": {60: 0.445, 15: 0.455}},
    "ringmaster-restart": {60: 0.981, 15: 0.918, "next_step": {60: 0.60, 15: 0.60}},
    "torchft": {60: 0.885, 15: 0.618, "next_step": {60: 5.06, 15: 5.30}},
    "torchrun": {60: 0.911, 15: 0.741, "next_step": {60: 4.20, 15: 3.80}},
}
PEERS_STEP_S = 0.05  # --step-time of benchmarks/peers.py
PEERS_CHECKPOINT_STEPS = 10  # the script's checkpoint cadence under torchrun and tier 0
PEERS_RESTART_S = 5.0  # assumed: a killed node started again is back (imports) after this
#: the largest gap between predicted and measured effective training (points) aimed at
TARGET_GAP_POINTS = 3.0
PHASES = 10  # kill times spread over a checkpoint interval, averaged


def scale_rows(sizes: tuple[int, ...], days: float, seeds: int) -> list[dict[str, Any]]:
    """One row per size and tier: ETTR, GPU-hours lost per day by cause, the settings."""
    failures = PRESETS["llama3"]
    horizon = days * 86400.0
    rows = []
    for gpus in sizes:
        job = JobShape(
            nodes=gpus // GPUS_PER_NODE,
            gpus_per_node=GPUS_PER_NODE,
            step_s=STEP_S,
            state_gb=STATE_GB,
        )
        model = recovery_model(job)
        started = time.perf_counter()
        rec = recommend(job, failures, model, Tier.IN_PROCESS, horizon, seeds)
        plan_s = time.perf_counter() - started
        for tier in (Tier.TORCHRUN, Tier.TORCHFT, Tier.RESTART, Tier.IN_PROCESS):
            tm = model.tiers[tier]
            if tier is Tier.IN_PROCESS:
                shaped = replace(job, spares=rec.spares, checkpoint_every_s=rec.cadence_s)
            else:
                every = young_daly_s(tm.checkpoint_block_s, mtbf_s(job, failures, tm))
                shaped = replace(job, spares=rec.spares, checkpoint_every_s=every)
            runs = [simulate(shaped, tm, horizon, failures=failures, seed=s) for s in range(seeds)]
            lost = {
                k: sum(r.lost_gpu_h[k] for r in runs) / seeds / days for k in runs[0].lost_gpu_h
            }
            rows.append(
                {
                    "gpus": gpus,
                    "tier": tier.value,
                    "ettr": round(sum(r.ettr for r in runs) / seeds, 4),
                    "gpu_h_lost_per_day": round(sum(lost.values())),
                    "lost_by_cause": {k: round(v) for k, v in lost.items() if v >= 0.5},
                    "spares": shaped.spares if tm.uses_spares else 0,
                    "checkpoint_every_s": round(shaped.checkpoint_every_s),
                    "exhaustions": sum(r.exhaustions for r in runs) / seeds,
                    "plan_s": round(plan_s, 2) if tier is Tier.IN_PROCESS else None,
                }
            )
    return rows


def month_at_16k() -> float:
    """Seconds to simulate a month of a 16,384-GPU job (in-process tier, one run)."""
    job = JobShape(nodes=2048, gpus_per_node=8, spares=16, step_s=STEP_S, state_gb=STATE_GB)
    tier = recovery_model(job).tiers[Tier.IN_PROCESS]
    started = time.perf_counter()
    simulate(job, tier, 30 * 86400.0, failures=PRESETS["llama3"], seed=0)
    return time.perf_counter() - started


def _peers_tier(name: str, period: int) -> TierModel:
    """A tier with the costs docs/peers.md measured for ``name`` under a kill every ``period``."""
    next_step = PEERS_MEASURED[name]["next_step"][period]
    # the kill -> the next completed step includes that step: the job stopped for the
    # rest, and lost the step in flight (counted by the simulator)
    stop = max(0.0, next_step - PEERS_STEP_S)
    job = JobShape(nodes=2, gpus_per_node=1, step_s=PEERS_STEP_S, state_gb=0.0)
    measured = Measured(torchft_group_nodes=1)
    base = recovery_model(job, measured).tiers[Tier(name)]
    rework = name in ("ringmaster-restart", "torchrun")
    cost = Cost(detect_s=stop, rework=rework, source=f"docs/peers.md: {next_step} s")
    if name == "torchft":
        cost = Cost(detect_s=stop, source=f"docs/peers.md: {next_step} s")
    return replace(
        base,
        costs={**base.costs, FaultKind.CRASH: cost},
        checkpoint_block_s=0.0,
        rejoin_s=measured.torchft_rejoin_s if name == "torchft" else 0.0,
        # the quiet run's kills all found a warm spare: the node back after
        # PEERS_RESTART_S stands for its warm-up
        spare_warmup_s=0.0,
    )


def validation_rows() -> list[dict[str, Any]]:
    """benchmarks/peers.py's goodput schedule replayed: predicted beside measured."""
    rows = []
    for period, window in ((60, 100.0), (15, 60.0)):
        for name, measured in PEERS_MEASURED.items():
            tier = _peers_tier(name, period)
            every = PEERS_CHECKPOINT_STEPS * PEERS_STEP_S
            job = JobShape(
                nodes=2,
                gpus_per_node=1,
                spares=1,
                min_nodes=1 if name == "torchft" else 2,
                step_s=PEERS_STEP_S,
                state_gb=0.0,
                checkpoint_every_s=every,
            )
            ettrs = []
            for k in range(PHASES):
                shift = (k + 0.5) / PHASES * every
                kills = [period / 2 + i * period + shift for i in range(int(window // period) + 1)]
                schedule = [
                    Fault(at, FaultKind.CRASH, 1, PEERS_RESTART_S) for at in kills if at < window
                ]
                ettrs.append(simulate(job, tier, window, schedule=schedule).ettr)
            predicted = sum(ettrs) / len(ettrs)
            rows.append(
                {
                    "schedule": f"kill every {period} s over {window:g} s",
                    "system": name,
                    "predicted": round(predicted, 4),
                    "measured": measured[period],
                    "gap_points": round(abs(predicted - measured[period]) * 100, 2),
                }
            )
    return rows


def read_json_line(path: Path) -> dict[str, Any]:
    """The last line of ``path`` that is a JSON object (a benchmark's result line)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SystemExit(f"--peers-json {path}: cannot read it: {e}") from e
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    raise SystemExit(
        f"--peers-json {path}: no line of it is a JSON object; give the output of "
        "`benchmarks/peers.py` (its last line is the JSON)"
    )


def replay_rows(runs: list[RecordedRun]) -> list[dict[str, Any]]:
    """Each recorded run replayed with its own costs and, for the in-process tier, with the
    model's (warm swap + spare warm-up): predicted beside measured."""
    swaps = [r for r in runs if r.tier is Tier.IN_PROCESS]
    warm_stop, warmup = warm_stop_from(swaps), spare_warmup_from(swaps)
    if warmup is None:  # no kill waited: warm-up below every gap; the measured default
        warmup = Measured().spare_warmup_s
    rows = []
    for run in runs:
        replayed = effective(run, replay(run))
        row: dict[str, Any] = {
            "run": run.name,
            "kills": len(run.faults),
            "measured": round(run.measured, 4),
            "replay": round(replayed, 4),
            "replay_gap_points": round(abs(replayed - run.measured) * 100, 2),
            "each_stop_s": [None if f.stop_s is None else round(f.stop_s, 3) for f in run.faults],
        }
        if run.tier is Tier.IN_PROCESS and run.spares and warm_stop is not None:
            sim = model(run, warm_stop, warmup)
            modelled = effective(run, sim)
            row.update(
                model=round(modelled, 4),
                model_gap_points=round(abs(modelled - run.measured) * 100, 2),
                model_warm_stop_s=round(warm_stop, 3),
                model_spare_warmup_s=round(warmup, 2),
                model_waits=sim.exhaustions,
                recorded_waits=sum(1 for f in run.faults if f.waited_s > 0),
            )
        rows.append(row)
    return rows


def print_replay(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    for r in rows:
        said = f"replay {r['replay'] * 100:6.2f}% (gap {r['replay_gap_points']:.2f})"
        if "model" in r:
            said += (
                f"  model {r['model'] * 100:6.2f}% (gap {r['model_gap_points']:.2f}; "
                f"warm swap {r['model_warm_stop_s']} s, spare warm-up "
                f"{r['model_spare_warmup_s']} s, {r['model_waits']} waits vs "
                f"{r['recorded_waits']} recorded)"
            )
        print(f"  {r['run']:<42} measured {r['measured'] * 100:6.2f}%  {said}")


def assumptions() -> list[str]:
    m = Measured()
    failures = PRESETS["llama3"]
    return [
        *failures.assumptions,
        f"job: nodes of {GPUS_PER_NODE} GPUs, one size (nodes.min = nodes), step {STEP_S:g} s, "
        f"{STATE_GB:g} GB of state per node, DDP-like (shrinks by one node)",
        f"ringmaster in-process: detect {m.detect_small_s} s + {m.detect_per_1000_nodes_s} s "
        "per 1,000 nodes (README recovery.py; docs/control-plane.md at 1,000 nodes), "
        f"rendezvous {m.rendezvous_s} s, heal at {m.heal_gbps} GB/s (README recovery_at_size.py), "
        f"async save blocks {m.async_block_fraction:g} of torch.save (README checkpoint.py)",
        f"ringmaster restart tier: relaunch {m.relaunch_s} s + script init {m.script_init_s} s "
        f"+ load at {m.load_gbps} GB/s (README restart_at_size.py); torch.save at "
        f"{m.save_gbps} GB/s (README checkpoint.py --device cuda)",
        f"torchrun: {m.torchrun_restart_s} s to the next step (docs/peers.md, 2 nodes) + the "
        f"same init and load; a hang waits NCCL's {m.torchrun_hang_s:.0f} s default timeout",
        f"torchft: {m.torchft_stall_s} s stall per failure (docs/peers.md); a group rejoins "
        f"{m.torchft_rejoin_s} s + heal after its node is back (assumed); groups of "
        f"{m.torchft_group_nodes} nodes; runs down to one group",
        "measured costs come from 2-3 processes on one 2-core machine; at thousands of nodes "
        "NCCL's group formation and a c10d rendezvous are slower and not measured",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="smallest configuration, seconds")
    parser.add_argument("--days", type=float, default=30.0, help="simulated days per run")
    parser.add_argument("--seeds", type=int, default=3, help="runs averaged per row")
    parser.add_argument("--skip-validate", action="store_true", help="leave out the replay")
    parser.add_argument(
        "--peers-json",
        type=Path,
        help="the output (last line: JSON) of a benchmarks/peers.py run to replay; "
        "without it, docs/peers.md's quiet-run figures (typed in)",
    )
    parser.add_argument("--from-run", metavar="JOB", help="replay this job's records too")
    parser.add_argument("--etcd", default="127.0.0.1:2379", help="etcd of --from-run's job")
    args = parser.parse_args(argv)
    sizes, days, seeds = (SIZES[:1], 2.0, 1) if args.smoke else (SIZES, args.days, args.seeds)
    print("assumptions:")
    for line in assumptions():
        print(f"  - {line}")
    started = time.perf_counter()
    rows = scale_rows(sizes, days, seeds)
    head = f"{'GPUs':>8}  {'tier':<22} {'ETTR':>8} {'GPU-h lost/day':>15}"
    print(f"\n{head}  spares  cadence  lost by cause")
    for r in rows:
        causes = ", ".join(f"{k} {v:,}" for k, v in r["lost_by_cause"].items())
        ettr, lost = f"{r['ettr'] * 100:>7.2f}%", f"{r['gpu_h_lost_per_day']:>15,}"
        settings = f"{r['spares']:>7} {r['checkpoint_every_s']:>7}s"
        print(f"{r['gpus']:>8,}  {r['tier']:<22} {ettr} {lost} {settings}  {causes}")
    month_s = month_at_16k()
    print(
        f"\na month of 16,384 GPUs simulated in {month_s:.3f} s (target 10 s); "
        f"all rows in {time.perf_counter() - started:.1f} s"
    )
    out: dict[str, Any] = {
        "benchmark": "goodput_at_scale",
        "days": days,
        "seeds": seeds,
        "rows": rows,
        "month_16k_s": round(month_s, 4),
    }
    at_16k = [r for r in rows if r["gpus"] == 16_384 and r["tier"] == Tier.IN_PROCESS.value]
    if at_16k:
        out["in_process_16k_ettr"] = at_16k[0]["ettr"]
    if not args.skip_validate and args.peers_json is not None:
        runs = runs_from_peers(read_json_line(args.peers_json), str(args.peers_json))
        checks = replay_rows(runs)
        print_replay(f"replay of the goodput rows of {args.peers_json} (its own records):", checks)
        out["validation_source"] = str(args.peers_json)
        out["validation"] = checks
        out["max_replay_gap_points"] = max(c["replay_gap_points"] for c in checks)
        modelled = [c["model_gap_points"] for c in checks if "model" in c]
        if modelled:
            out["max_model_gap_points"] = max(modelled)
    elif not args.skip_validate:
        checks = validation_rows()
        print(
            "\nreplay of benchmarks/peers.py's goodput schedule, with figures TYPED IN from "
            "docs/peers.md's quiet run (no --peers-json given):"
        )
        for c in checks:
            said = f"predicted {c['predicted'] * 100:6.2f}%  measured {c['measured'] * 100:6.2f}%"
            print(
                f"  {c['schedule']:<28} {c['system']:<22} {said}  gap {c['gap_points']:.2f} points"
            )
        out["validation_source"] = "typed in: docs/peers.md, the quiet run"
        out["validation"] = checks
        out["max_gap_points"] = max(c["gap_points"] for c in checks)
    if args.from_run:
        from orchestrator.etcd.client import connect
        from orchestrator.etcd.options import EtcdOptions
        from orchestrator.planning.from_run import recorded_run

        client = connect(EtcdOptions(endpoints=tuple(args.etcd.split(","))))
        try:
            job_rows = replay_rows([recorded_run(client, args.from_run)])
        finally:
            client.close()
        print_replay(f"replay of job {args.from_run}'s records (etcd {args.etcd}):", job_rows)
        out["from_run"] = job_rows
    if args.smoke:
        out["smoke"] = True
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
