"""Training across a slow link: DDP, compressed DDP, DiLoCo and Streaming DiLoCo side by side.

Two sites (``zone`` a and b, one node of one rank each: this machine has two
cores) in network namespaces joined by one link limited with ``tc … tbf`` in
both directions (:mod:`_site_link`); etcd and the controller run on the host,
each site's agents in its namespace, gloo bound to the site link.  Every row is
a whole ringmaster job of the flagship LM (``examples/train_lm.py``, widened to
``--width`` x ``--layers`` so that its gradients weigh on the link), all rows
at equal tokens (the same ``max_steps`` and global batch):

* ``ddp`` with no limit on the link (a FIFO that only counts): the reference;
* ``ddp``, ``powersgd`` (DDP with the PowerSGD hook, the best compression of
  ``benchmarks/allreduce.py``), ``diloco`` and ``streaming`` across the limited
  link, at each rate of ``--rates`` (100 Mbit/s, then 1 Gbit/s);
* ``diloco_kill``: DiLoCo across the first rate with a warm spare in site b;
  site b's only node is SIGKILLed (agent and worker) mid inner period, the spare
  takes its slot and, its site having no live state left, starts from the
  global parameters (the anchors of the last outer step);
* ``diloco_kill_peer``: the same with site b of two nodes (three ranks in all,
  so more tokens per step than the other rows: its loss is not compared), one
  of which is SIGKILLed: the spare takes the site's state from the live peer
  in its own site, and nothing of it crosses the slow link.

Per row: steps per second (rank 0's step log, from step ``WARM_STEPS`` to the
last logged step, so the start-up is not counted), bytes across the link per
step (tc's counters on both ends over the whole job: every byte one site sent
the other), their ratio to ``ddp``'s in fp32 across the same link, and the
held-out loss at the end (``evaluate`` in the example; rank 0's: site a's model,
the one a checkpoint keeps).  The kill row adds the seconds from the failure to
the job's next step (the controller's ``Recovered`` event) and steps lost, and
the outer steps lost or applied twice: each rank's count of outer steps at the
end (``Session.outer_steps``, per fragment) against the same rank's in the
fault-free DiLoCo row at the same rate (``--only`` both rows to get it).

Needs root (``ip netns``, ``tc``); prints ``SKIPPED`` and a JSON object saying
why otherwise.  The last stdout line is one JSON object of headline figures.

Usage::

    python benchmarks/cross_site.py [--rates 100mbit,1gbit] [--steps 120] [--width 256]

``--smoke``: every row at one rate (1 Gbit/s), 40 steps of a 32-wide one-layer
model (the kill rows 300: their spare must be up first), H 4, two fragments, timed from
step 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
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
    "steps": 40,
    "width": 32,
    "layers": 1,
    "inner_steps": 4,
    "fragments": 2,
    "delay_steps": 1,
    "warm_steps": 2,
    "kill_steps": 300,
}
#: Seconds a row may take before it counts as failed.
ROW_TIMEOUT_S = float(os.environ.get("RINGMASTER_BENCH_TIMEOUT", "900"))


@dataclass(frozen=True)
class Row:
    """One job: its name, the link's rate (``None``: no limit), its comm and sync sections."""

    name: str
    rate: str | None
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


def rows(args: argparse.Namespace) -> list[Row]:
    """The rows of one run, in order (see the module docstring)."""
    powersgd = {"compression": {"type": "powersgd", "rank": 4, "start_iter": args.warm_steps}}
    outer = {"name": args.outer_optimizer, "lr": args.outer_lr, "momentum": args.outer_momentum}
    diloco = {"mode": "diloco", "inner_steps": args.inner_steps, "outer_optimizer": outer}
    streaming = {
        "mode": "streaming_diloco",
        "inner_steps": args.inner_steps,
        "fragments": args.fragments,
        "delay_steps": args.delay_steps,
        "outer_quantization": "4bit",
        "outer_optimizer": outer,
    }
    out = [Row("ddp_nolimit", None)]
    for rate in args.rates.split(","):
        out += [
            Row(f"ddp_{rate}", rate),
            Row(f"powersgd_{rate}", rate, comm=powersgd),
            Row(f"diloco_{rate}", rate, sync=diloco),
            Row(f"streaming_{rate}", rate, sync=streaming),
        ]
    if not args.no_kill:
        first = args.rates.split(",")[0]
        steps = args.kill_steps or None
        out += [
            Row(f"diloco_kill_{first}", out[1].rate, sync=diloco, kill=True, steps=steps),
            Row(
                f"diloco_kill_peer_{first}",
                out[1].rate,
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
    return load_job_data(
        {
            "name": f"xsite-{row.name.replace('_', '-')}",
            "entrypoint": {"script": str(REPO / "examples" / "train_lm.py"), "args": train},
            "nodes": {"min": 2 + row.peer, "max": 2 + row.peer, "spares": 1 if row.kill else 0},
            "nproc_per_node": 1,
            "max_steps": row.steps or args.steps,
            "checkpoint": {"url": f"file://{out}/ckpt", "every_steps": 0},
            "comm": row.comm,
            "sync": row.sync,
            "fault_tolerance": {"hang_timeout": "120s", "heartbeat_interval": "500ms"},
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

    out = tmp / row.name
    spec = job_spec(row, args, out)
    job = spec.name
    lines = TimedLines()
    link.limit(row.rate)
    site_a, site_b = link.sites
    recovered: dict[str, Any] = {}
    killed_step = None
    with (
        _kept(lines, args.keep_logs, row.name),
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


def _step_rate(lines: TimedLines, warm_steps: int = WARM_STEPS) -> float:
    """Steps per second between rank 0's logged step ``warm_steps`` and its last logged step."""
    logged = []
    for t, line in zip(lines.times, lines, strict=True):
        m = re.search(r"\bstep (\d+) loss ", line)
        if m and int(m.group(1)) >= warm_steps:
            logged.append((int(m.group(1)), t))
    if len(logged) < 2:
        raise RuntimeError(f"fewer than two logged steps past {warm_steps}: {logged}")
    (s0, t0), (s1, t1) = logged[0], logged[-1]
    return (s1 - s0) / (t1 - t0)


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _site_link import SiteLink

    from tests.faults.etcd_cluster import EtcdCluster

    results: dict[str, dict[str, Any]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="rm-cross-site-"))
    link = SiteLink()
    try:
        link.build()
        hosts = tuple(s.node.host_ip for s in link.sites)
        print(
            f"two sites in namespaces, one link between them ({link.sites[0].wan_ip} <-> "
            f"{link.sites[1].wan_ip}); train_lm width {args.width} x {args.layers} layers, "
            f"{args.steps} steps",
            flush=True,
        )
        with EtcdCluster(1, extra_hosts=hosts) as etcd:
            for row in rows(args):
                if args.only and row.name not in args.only.split(","):
                    continue
                started = time.monotonic()
                r = results[row.name] = run_row(row, args, link, etcd, tmp)
                sites = [round(x, 4) for x in r["eval_loss_sites"]]
                print(
                    f"  {row.name:22s} {r['steps_per_s']:6.2f} steps/s  "
                    f"{r['link_bytes_per_step'] / 1e6:9.3f} MB/step across the link  "
                    f"eval loss {r['eval_loss']:.4f} (sites {sites})  "
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


def summary(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The headline figures: one flat JSON object, units in the names (relative figures
    only where their reference row ran)."""
    ref = results.get("ddp_nolimit")
    out: dict[str, Any] = {
        "model": f"train_lm width {args.width} layers {args.layers}",
        "steps": args.steps,
        "inner_steps": args.inner_steps,
        "streaming_fragments": args.fragments,
        "streaming_delay_steps": args.delay_steps,
        "outer_optimizer": f"{args.outer_optimizer} lr {args.outer_lr} momentum "
        f"{args.outer_momentum}",
    }
    for name, r in results.items():
        out[f"{name}_steps_per_s"] = round(r["steps_per_s"], 3)
        out[f"{name}_link_kb_per_step"] = round(r["link_bytes_per_step"] / 1e3, 1)
        out[f"{name}_eval_loss"] = round(r["eval_loss"], 4)
        # DDP in fp32 sends the same bytes whatever the link: the no-limit row stands in
        ddp = results.get(f"ddp_{name.rsplit('_', 1)[1]}") or ref
        if ddp is not None and r["link_bytes_per_step"]:
            ratio = ddp["link_bytes_per_step"] / r["link_bytes_per_step"]
            out[f"{name}_bytes_vs_ddp_fp32_x"] = round(ratio, 1)
        if ref is not None and r is not ref and not r.get("three_ranks"):
            out[f"{name}_pct_of_nolimit_rate"] = round(
                100 * r["steps_per_s"] / ref["steps_per_s"], 1
            )
            out[f"{name}_eval_loss_vs_nolimit_pct"] = round(
                100 * (r["eval_loss"] / ref["eval_loss"] - 1), 2
            )
        if any(r["outer_steps"]):
            out[f"{name}_outer_steps_by_rank"] = r["outer_steps"]
        fault_free = results.get(name.replace("_kill", "").replace("_peer", ""))
        if r["recovery"] and fault_free is not None and fault_free is not r:
            out[f"{name}_outer_steps_lost_or_twice"] = outer_steps_off(r, fault_free)
        if r["recovery"]:
            rec = r["recovery"]
            out[f"{name}_recovery_s"] = round(float(rec.get("total_s", -1)), 3)
            out[f"{name}_recovery_phases_s"] = rec.get("phases")
            out[f"{name}_killed_at_step"] = rec.get("killed_step")
            out[f"{name}_spare_from_anchors"] = rec.get("spare_from_anchors")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,1gbit", help="site link rates, each way")
    parser.add_argument("--steps", type=int, default=120, help="max_steps of every row")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=24, help="H of both DiLoCo rows")
    parser.add_argument("--fragments", type=int, default=4, help="Streaming DiLoCo's F")
    parser.add_argument("--delay-steps", type=int, default=2, help="Streaming DiLoCo's tau")
    parser.add_argument("--outer-optimizer", default="nesterov", help="nesterov or sgd")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="both DiLoCo rows'")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="both DiLoCo rows'")
    parser.add_argument("--no-kill", action="store_true", help="skip the SIGKILL row")
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
