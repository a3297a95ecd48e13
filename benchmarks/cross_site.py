"""Training across a slow link: DDP, compressed DDP, DiLoCo and Streaming DiLoCo side by side.

Two sites (``zone`` a and b, one node each of ``--ranks-per-site`` ranks: DDP
runs inside a site) in network namespaces joined by one link limited with
``tc … tbf`` in both directions (:mod:`_site_link`); etcd and the controller run
on the host, each site's agents in its namespace, gloo bound to the site link,
so that a site's own ranks talk over its loopback and everything between the
sites crosses the limited link.  Every row is a whole ringmaster job of the
flagship LM (``examples/train_lm.py`` at its own size, 64 wide and 2 layers,
as ``examples/diloco.yaml`` runs it) on the source of the Python standard
library (``--corpus stdlib``: about 30 MB, which the model cannot memorize in
the run; whole files held out, about 1.5 MB, every byte of it evaluated at the
end), all rows at equal tokens (the same ``max_steps`` and global batch), each
row once per seed of ``--seeds`` (the initial weights and the data order):

* ``ddp`` with no limit on the link (a FIFO that only counts): the reference;
* ``ddp`` across the limited link, at each rate of ``--rates``;
* ``diloco`` and ``streaming`` across it at the papers' settings, which are the
  job file's defaults: the Nesterov outer step (lr 0.7, momentum 0.9), and for
  Streaming DiLoCo 4-bit floats (e3m0) and ``alpha`` 0.5; H as
  ``examples/diloco.yaml`` (20), 40 outer steps (800 steps);
* extra rows, each with its flag: ``--powersgd``, DDP with the PowerSGD hook
  across the link; ``--averaging``, DiLoCo with plain averaging as the outer
  step (SGD, lr 1, no momentum: local SGD); ``--int4``, Streaming DiLoCo with
  the uniform 4-bit integers (a scale per block of 256) instead of e3m0;
* ``--kill``: ``diloco_kill``, DiLoCo with a warm spare in site b, site b's
  only node SIGKILLed (agent and workers) mid inner period: the spare takes its
  slot and, its site having no live state left, starts from the global
  parameters; and ``diloco_kill_peer``, site b of two nodes, one of them
  SIGKILLed (more ranks, so more tokens per step: its loss is not compared).
  Both run for the first seed only, without the curve's evaluations: rank 0
  evaluating for seconds while the kill lands would count in the recovery.

Per row and seed: steps per second (rank 0's step log, from step ``WARM_STEPS``
to the last logged step, less the seconds of its ``--eval-every`` evaluations,
so neither the start-up nor the curve is counted), bytes across the link per
step (tc's counters on both ends over the whole job: every byte one site sent
the other), their ratio to ``ddp``'s in fp32 across the same link, and the
held-out loss at the end (rank 0's: site a's model, the one a checkpoint keeps);
its gap to ``ddp_nolimit`` of the same seed, then the mean and the spread of
the gaps over the seeds.  With ``--eval-every`` (default: every 4 outer steps),
rank 0 logs the loss on the first 256 KB held out along the way, and the
summary gives the mean gap at each point, by outer step: the curve.  The kill
rows add the seconds from the failure to the job's next step (the controller's
``Recovered`` event), and the outer steps lost or applied twice: each rank's
count of outer steps at the end (``Session.outer_steps``, per fragment) against
the same rank's in the fault-free DiLoCo row of the same seed.

Needs root (``ip netns``, ``tc``); prints ``SKIPPED`` and a JSON object saying
why otherwise.  The last stdout line is one JSON object of headline figures.

Usage::

    python benchmarks/cross_site.py [--rates 100mbit] [--seeds 0,1,2] [--steps 800]

``--smoke``: every row (the extras too) at one rate (1 Gbit/s), one seed, one
rank per site, 40 steps of a 32-wide one-layer model on ``argparse.py`` (the
kill rows 300: their spare must be up first), H 4, two fragments, timed from
step 2.  (``tests/benchmarks/test_cross_site_bench.py`` runs a row with two
ranks per site.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from statistics import mean
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchmarks._smoke import parse, result_line  # noqa: E402
from orchestrator.etcd.grpc_env import apply_grpc_environment  # noqa: E402

# before gRPC is imported: this process forks agents (see orchestrator.etcd.grpc_env)
apply_grpc_environment()

#: Steps not timed at the start of a row (process groups, first state sync, warm caches).
WARM_STEPS = 10
LOG_EVERY = 1
#: ``--smoke``: one rate, a tiny model, short inner periods, every row.
SMOKE = {
    "rates": "1gbit",
    "seeds": "0",
    "ranks_per_site": 1,
    "corpus": "argparse",
    "steps": 40,
    "width": 32,
    "layers": 1,
    "inner_steps": 4,
    "fragments": 2,
    "delay_steps": 1,
    "warm_steps": 2,
    "eval_every": 20,
    "powersgd": True,
    "averaging": True,
    "int4": True,
    "kill": True,
    "kill_steps": 300,
}
#: Seconds a row may take before it counts as failed.
ROW_TIMEOUT_S = float(os.environ.get("RINGMASTER_BENCH_TIMEOUT", "900"))


@dataclass(frozen=True)
class Row:
    """One job: its name, the link's rate (``None``: no limit), its comm and sync sections."""

    name: str
    rate: str | None
    seed: int = 0
    comm: dict[str, Any] = field(default_factory=dict)
    sync: dict[str, Any] = field(default_factory=dict)
    kill: bool = False
    #: site b has two nodes (the killed one has a live peer in its site)
    peer: bool = False
    #: max_steps, where not ``--steps`` (``--kill-steps``: the kill rows')
    steps: int | None = None


class TimedLines(list[str]):
    """Output lines with the time each arrived (the services' pumps append to it)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def append(self, line: str) -> None:
        self.times.append(time.monotonic())
        super().append(line)


def seeds(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.seeds.split(",")]


def rows(args: argparse.Namespace) -> list[Row]:
    """The rows of one run, in order (see the module docstring): every seed of a row
    before the next row."""
    powersgd = {"compression": {"type": "powersgd", "rank": 4, "start_iter": args.warm_steps}}
    diloco: dict[str, Any] = {"mode": "diloco", "inner_steps": args.inner_steps}
    streaming: dict[str, Any] = {
        "mode": "streaming_diloco",
        "inner_steps": args.inner_steps,
        "fragments": args.fragments,
        "delay_steps": args.delay_steps,
    }
    if args.outer_optimizer:  # otherwise the papers' (the spec's defaults)
        name, lr, momentum = args.outer_optimizer.split(",")
        outer = {"name": name, "lr": float(lr), "momentum": float(momentum)}
        diloco["outer_optimizer"] = streaming["outer_optimizer"] = outer
    if args.outer_quantization:
        streaming["outer_quantization"] = args.outer_quantization
    shapes = [Row("ddp_nolimit", None)]
    for rate in args.rates.split(","):
        shapes.append(Row(f"ddp_{rate}", rate))
        if args.powersgd:
            shapes.append(Row(f"powersgd_{rate}", rate, comm=powersgd))
        shapes += [
            Row(f"diloco_{rate}", rate, sync=diloco),
            Row(f"streaming_{rate}", rate, sync=streaming),
        ]
        if args.averaging:
            averaging = {"name": "sgd", "lr": 1.0, "momentum": 0.0}
            shapes.append(
                Row(f"diloco_avg_{rate}", rate, sync={**diloco, "outer_optimizer": averaging})
            )
        if args.int4:
            int4 = {**streaming, "outer_quantization": "4bit"}
            shapes.append(Row(f"streaming_int4_{rate}", rate, sync=int4))
    out = [dataclasses.replace(r, seed=seed) for r in shapes for seed in seeds(args)]
    if args.kill:
        first = args.rates.split(",")[0]
        steps = args.kill_steps or None
        out += [
            Row(f"diloco_kill_{first}", first, seeds(args)[0], sync=diloco, kill=True, steps=steps),
            Row(
                f"diloco_kill_peer_{first}",
                first,
                seeds(args)[0],
                sync=diloco,
                kill=True,
                peer=True,
                steps=steps,
            ),
        ]
    return out


def job_spec(row: Row, args: argparse.Namespace, out: Path) -> Any:
    from orchestrator.spec.loader import load_job_data

    train = ["--width", str(args.width), "--layers", str(args.layers), "--accum", "2"]
    train += ["--warmup", "20", "--log-every", str(LOG_EVERY), "--out", str(out)]
    train += ["--corpus", args.corpus, "--seed", str(row.seed), "--final-eval", "first-of-node"]
    if args.eval_every and not row.kill:  # rank 0's pause would count in the recovery
        train += ["--eval-every", str(args.eval_every)]
    return load_job_data(
        {
            "name": f"xsite-{row.name.replace('_', '-')}-s{row.seed}",
            "entrypoint": {"script": str(REPO / "examples" / "train_lm.py"), "args": train},
            "nodes": {"min": 2 + row.peer, "max": 2 + row.peer, "spares": 1 if row.kill else 0},
            "nproc_per_node": args.ranks_per_site,
            "max_steps": row.steps or args.steps,
            "checkpoint": {"url": f"file://{out}/ckpt", "every_steps": 0},
            # rank 0 alone evaluates the curve's points while the others wait in a
            # collective: that pause is not a lost peer (README, "GPUs and NCCL")
            "comm": {**row.comm, "op_timeout_floor": "120s"},
            "sync": row.sync,
            # the workers' final evaluation runs inside the agents' end grace (hang_timeout)
            "fault_tolerance": {"hang_timeout": "600s", "heartbeat_interval": "500ms"},
        }
    )


# --------------------------------------------------------------------------- one row


def _wait(what: str, check: Callable[[], Any], timeout: float, lines: list[str]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    tail = "\n".join(lines[-40:])
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}; last output:\n{tail}")


def run_row(row: Row, args: argparse.Namespace, link: Any, etcd: Any, tmp: Path) -> dict[str, Any]:
    """Run ``row``'s job to its end; its figures (see the module docstring)."""
    from orchestrator.etcd.client import connect
    from orchestrator.etcd.options import EtcdOptions
    from orchestrator.state import events, jobs, keys, records
    from orchestrator.state.records import Plan
    from tests.faults.processes import Services

    out = tmp / f"{row.name}-s{row.seed}"
    spec = job_spec(row, args, out)
    job = spec.name
    lines = TimedLines()
    link.limit(row.rate)
    site_a, site_b = link.sites
    recovered: dict[str, Any] = {}
    killed_step = None
    with (
        _kept(lines, args.keep_logs, f"{row.name}-s{row.seed}"),
        Services(lines) as services,
        connect(EtcdOptions(etcd.endpoints)) as client,
    ):
        jobs.submit(client, spec)
        services.start(
            "controller", ["controller", "--job", job, "--etcd", ",".join(etcd.endpoints)]
        )

        def agent(node: str, site: Any) -> None:
            labels = f"zone={site.name},rack=r{site.name},host={node}"
            endpoints = ",".join(etcd.endpoints_on(site.node.host_ip))
            argv = ["agent", "--job", job, "--node", node, "--labels", labels]
            argv += ["--address", site.wan_ip, "--etcd", endpoints]
            env = {"GLOO_SOCKET_IFNAME": site.wan_if, "OMP_NUM_THREADS": "1"}
            services.start(node, argv, env=env, prefix=site.command([]))

        agent("node-a0", site_a)
        agent("node-b0", site_b)
        if row.peer:
            agent("node-b1", site_b)
        spare_node = "node-b2" if row.peer else "node-b1"
        if row.kill:
            _wait(
                "generation 1", lambda: records.read(client, keys.job_plan(job), Plan), 300, lines
            )
            agent(spare_node, site_b)  # the spare starts once both sites train: b0 is active
            # past half the run, mid inner period: the spare starts from the anchors of the
            # last outer step and has the inner steps since then to compute again
            kill_at, h = (row.steps or args.steps) // 2, args.inner_steps

            def due(step: int) -> bool:
                return step >= kill_at and h // 4 <= step % h <= 3 * h // 4

            spare = _wait(
                f"{spare_node} as a warm spare and a step past {kill_at}, mid inner period",
                lambda: (
                    (s := jobs.read_status(client, job))
                    and (s.phase.terminal or (spare_node in s.spare_nodes and due(s.step)))
                    and s
                ),
                ROW_TIMEOUT_S,
                lines,
            )
            if spare.phase.terminal:
                raise RuntimeError(f"{row.name} ended before the kill: give it more --steps")
            killed_step = spare.step
            services.signal("node-b0", 9)
            which = "one of site b's two nodes" if row.peer else "site b's only node"
            print(f"  {row.name}: SIGKILL node-b0 ({which}) at step {killed_step}")
        status = _wait(
            "the end of the job",
            lambda: (s := jobs.read_status(client, job)) and s.phase.terminal and s,
            ROW_TIMEOUT_S,
            lines,
        )
        # the agents leave once their workers end: each worker evaluates its model first
        for name, proc in services.procs.items():
            if name.startswith("node-"):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=ROW_TIMEOUT_S)
        found = [e for e in events.list_events(client, job) if e.type == "Recovered"]
        if found:
            recovered = dict(found[0].data)
            recovered["killed_step"] = killed_step
            recovered["spare_from_anchors"] = any(
                spare_node in line and "had no state" in line for line in lines
            )
    sent = link.bytes_sent()
    if status.phase.value != "Succeeded":
        raise RuntimeError(f"{row.name} ended {status.phase.value}:\n" + "\n".join(lines[-60:]))
    finals = [json.loads(p.read_text()) for p in sorted(out.glob("final-rank*.json"))]
    return {
        "steps_per_s": _step_rate(lines, args.warm_steps),
        "curve": _curve(lines),
        "link_bytes": sent,
        "link_bytes_per_step": sent / (row.steps or args.steps),
        "eval_loss": finals[0]["eval_loss"],
        "eval_loss_sites": [f["eval_loss"] for f in finals],
        "tokens": finals[0]["tokens"],
        "recovery": recovered,
        "outer_steps": [f.get("outer_steps", []) for f in finals],
        "three_ranks": row.peer,
    }


@contextlib.contextmanager
def _kept(lines: list[str], where: str, name: str) -> Iterator[None]:
    """Write ``lines`` to ``where/name.log`` at the end, however the row ended (``--keep-logs``)."""
    try:
        yield
    finally:
        if where:
            Path(where).mkdir(parents=True, exist_ok=True)
            Path(where, f"{name}.log").write_text("\n".join(lines) + "\n")


#: Rank 0's ``--eval-every`` line: the step after which, the loss, the seconds it took.
EVAL_LINE = re.compile(r"\beval after step (\d+) loss ([\d.]+) \(([\d.]+)s\)")


def _step_rate(lines: TimedLines, warm_steps: int = WARM_STEPS) -> float:
    """Steps per second between rank 0's logged step ``warm_steps`` and its last logged
    step, the seconds of the evaluations logged between them left out."""
    logged = []
    for t, line in zip(lines.times, lines, strict=True):
        m = re.search(r"\bstep (\d+) loss ", line)
        if m and int(m.group(1)) >= warm_steps and not EVAL_LINE.search(line):
            logged.append((int(m.group(1)), t))
    if len(logged) < 2:
        raise RuntimeError(f"fewer than two logged steps past {warm_steps}: {logged}")
    (s0, t0), (s1, t1) = logged[0], logged[-1]
    evals = sum(
        float(m.group(3))
        for t, line in zip(lines.times, lines, strict=True)
        if t0 < t <= t1 and (m := EVAL_LINE.search(line))
    )
    return (s1 - s0) / (t1 - t0 - evals)


def _curve(lines: list[str]) -> dict[int, float]:
    """Rank 0's ``--eval-every`` losses, by the number of steps trained."""
    return {int(m.group(1)) + 1: float(m.group(2)) for m in map(EVAL_LINE.search, lines) if m}


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _site_link import SiteLink

    from tests.faults.etcd_cluster import EtcdCluster

    results: dict[str, list[dict[str, Any]]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="rm-cross-site-"))
    link = SiteLink()
    try:
        link.build()
        hosts = tuple(s.node.host_ip for s in link.sites)
        print(
            f"two sites in namespaces, one link between them ({link.sites[0].wan_ip} <-> "
            f"{link.sites[1].wan_ip}), {args.ranks_per_site} rank(s) each; train_lm width "
            f"{args.width} x {args.layers} layers on --corpus {args.corpus}, {args.steps} "
            f"steps, seeds {args.seeds}",
            flush=True,
        )
        with EtcdCluster(1, extra_hosts=hosts) as etcd:
            for row in rows(args):
                if args.only and row.name not in args.only.split(","):
                    continue
                started = time.monotonic()
                r = run_row(row, args, link, etcd, tmp)
                r["seed"] = row.seed
                results.setdefault(row.name, []).append(r)
                ranks = [round(x, 4) for x in r["eval_loss_sites"]]
                print(
                    f"  {row.name:22s} seed {row.seed} {r['steps_per_s']:6.2f} steps/s  "
                    f"{r['link_bytes_per_step'] / 1e6:9.3f} MB/step across the link  "
                    f"eval loss {r['eval_loss']:.4f} (ranks {ranks})  "
                    f"[{time.monotonic() - started:.0f}s]",
                    flush=True,
                )
                if r["recovery"]:
                    print(f"    recovery: {r['recovery']}", flush=True)
    finally:
        link.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return summary(results, args)


def outer_steps_off(row: dict[str, Any], fault_free: dict[str, Any]) -> int:
    """Outer steps a row applied that its fault-free run did not, or missed: per rank
    and fragment, the difference of the counts each rank ended with, summed (a rank
    the fault-free run did not have is held to its rank 0: every rank applies every
    outer step)."""
    first = fault_free["outer_steps"][0] if fault_free["outer_steps"] else []
    ranks = zip_longest(row["outer_steps"], fault_free["outer_steps"], fillvalue=first)
    return sum(
        abs(got - want)
        for got_rank, want_rank in ranks
        for got, want in zip_longest(got_rank, want_rank, fillvalue=0)
    )


def gaps_pct(runs: list[dict[str, Any]], refs: list[dict[str, Any]]) -> list[float]:
    """Each seed's held-out loss against the reference's of the same seed, in percent."""
    ref = {r["seed"]: r["eval_loss"] for r in refs}
    return [100 * (r["eval_loss"] / ref[r["seed"]] - 1) for r in runs if r["seed"] in ref]


def curve_gap_pct(
    runs: list[dict[str, Any]], refs: list[dict[str, Any]], inner_steps: int
) -> dict[str, float]:
    """The mean over seeds of the gap to the reference at each point of the curve, by
    the number of outer steps (of H inner steps) done there."""
    ref = {r["seed"]: r["curve"] for r in refs}
    points: dict[int, list[float]] = {}
    for r in runs:
        for step, loss in r["curve"].items():
            if step in ref.get(r["seed"], {}):
                points.setdefault(step, []).append(100 * (loss / ref[r["seed"]][step] - 1))
    return {f"{step / inner_steps:g}": round(mean(v), 2) for step, v in sorted(points.items())}


def summary(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """The headline figures: one flat JSON object, units in the names, means over the
    seeds (relative figures only where their reference row ran)."""
    refs = results.get("ddp_nolimit")
    out: dict[str, Any] = {
        "model": f"train_lm width {args.width} layers {args.layers}",
        "corpus": args.corpus,
        "ranks_per_site": args.ranks_per_site,
        "seeds": seeds(args),
        "steps": args.steps,
        "inner_steps": args.inner_steps,
        "outer_steps": args.steps // args.inner_steps,
        "streaming_fragments": args.fragments,
        "streaming_delay_steps": args.delay_steps,
        "outer_optimizer": args.outer_optimizer or "the papers' (nesterov,0.7,0.9)",
        "streaming_outer_quantization": args.outer_quantization or "the paper's (e3m0)",
    }
    for name, runs in results.items():
        rate = mean(r["steps_per_s"] for r in runs)
        per_step = mean(r["link_bytes_per_step"] for r in runs)
        out[f"{name}_steps_per_s"] = round(rate, 3)
        out[f"{name}_link_kb_per_step"] = round(per_step / 1e3, 1)
        out[f"{name}_eval_loss"] = round(mean(r["eval_loss"] for r in runs), 4)
        # DDP in fp32 sends the same bytes whatever the link: the no-limit row stands in
        ddp = results.get(f"ddp_{name.rsplit('_', 1)[1]}") or refs
        if ddp is not None and per_step:
            ratio = mean(r["link_bytes_per_step"] for r in ddp) / per_step
            out[f"{name}_bytes_vs_ddp_fp32_x"] = round(ratio, 1)
        if refs is not None and runs is not refs and not runs[0].get("three_ranks"):
            out[f"{name}_pct_of_nolimit_rate"] = round(
                100 * rate / mean(r["steps_per_s"] for r in refs), 1
            )
            gaps = gaps_pct(runs, refs)
            if gaps:
                out[f"{name}_eval_loss_vs_nolimit_pct"] = round(mean(gaps), 2)
                out[f"{name}_eval_loss_vs_nolimit_pct_by_seed"] = [round(g, 2) for g in gaps]
                out[f"{name}_eval_loss_vs_nolimit_pct_spread"] = round(max(gaps) - min(gaps), 2)
            curve = curve_gap_pct(runs, refs, args.inner_steps)
            if curve and "ddp" not in name:
                out[f"{name}_eval_gap_pct_by_outer_step"] = curve
        r = runs[0]
        if any(r["outer_steps"]):
            out[f"{name}_outer_steps_by_rank"] = r["outer_steps"]
        fault_free = results.get(name.replace("_kill", "").replace("_peer", ""))
        if r["recovery"] and fault_free is not None and fault_free is not runs:
            same_seed = [f for f in fault_free if f["seed"] == r["seed"]]
            if same_seed:
                out[f"{name}_outer_steps_lost_or_twice"] = outer_steps_off(r, same_seed[0])
        if r["recovery"]:
            rec = r["recovery"]
            out[f"{name}_recovery_s"] = round(float(rec.get("total_s", -1)), 3)
            out[f"{name}_recovery_phases_s"] = rec.get("phases")
            out[f"{name}_killed_at_step"] = rec.get("killed_step")
            out[f"{name}_spare_from_anchors"] = rec.get("spare_from_anchors")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit", help="site link rates, each way")
    parser.add_argument("--seeds", default="0,1,2", help="each row once per seed (commas)")
    parser.add_argument("--ranks-per-site", type=int, default=2, help="each site's one node's")
    parser.add_argument("--corpus", default="stdlib", help="train_lm's --corpus")
    parser.add_argument("--steps", type=int, default=800, help="max_steps of every row")
    parser.add_argument("--width", type=int, default=64, help="train_lm's own: 64")
    parser.add_argument("--layers", type=int, default=2, help="train_lm's own: 2")
    parser.add_argument(
        "--inner-steps", type=int, default=20, help="H of both DiLoCo rows (examples/diloco.yaml's)"
    )
    parser.add_argument("--fragments", type=int, default=4, help="Streaming DiLoCo's F")
    parser.add_argument("--delay-steps", type=int, default=2, help="Streaming DiLoCo's tau")
    parser.add_argument(
        "--outer-optimizer",
        default="",
        help="name,lr,momentum of both DiLoCo rows' outer step (default: the papers')",
    )
    parser.add_argument(
        "--outer-quantization", default="", help="Streaming DiLoCo's (default: the paper's)"
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=-1,
        help="steps between the curve's points (0: none; default: 4 outer steps, 4 x H)",
    )
    parser.add_argument("--powersgd", action="store_true", help="add DDP + PowerSGD rows")
    parser.add_argument(
        "--averaging", action="store_true", help="add DiLoCo rows with averaging as the outer step"
    )
    parser.add_argument(
        "--int4", action="store_true", help="add Streaming rows with the uniform 4-bit integers"
    )
    parser.add_argument("--kill", action="store_true", help="add the SIGKILL rows")
    parser.add_argument("--only", default="", help="run only these rows (names, commas)")
    parser.add_argument("--keep-logs", default="", help="directory: each row's output")
    parser.add_argument(
        "--kill-steps", type=int, default=0, help="max_steps of the kill rows (0: --steps)"
    )
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=WARM_STEPS,
        help="steps not timed at the start of a row; PowerSGD's start_iter",
    )
    args = parse(parser, SMOKE)
    if args.eval_every < 0:
        args.eval_every = 4 * args.inner_steps
    from tests.faults.netns import unavailable_reason

    reason = unavailable_reason()
    if reason is None and shutil.which("tc") is None:
        reason = "the `tc` command (iproute2) is not installed"
    if reason is not None:
        print(f"SKIPPED: two sites need network namespaces and tc ({reason})")
        print(result_line({"skipped": True, "reason": reason}, args.smoke))
        return 0
    print(result_line(run(args), args.smoke))
    return 0


if __name__ == "__main__":
    sys.exit(main())
