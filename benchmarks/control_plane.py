"""The control plane at scale: a real etcd, the real controller, N x W simulated workers.

Nothing trains.  A real etcd (one member, or ``--cluster 3``: the tests'
three-member cluster), both with the product's revision-based compaction
and quota (``k8s/etcd.yaml``, the embedded etcd; ``--compaction`` changes it),
a real controller process (``ringmaster controller --metrics-port 0``, as
``ringmaster run`` starts it), and ``--nodes`` simulated node agents of
``--workers`` workers each, in one or a few processes
(:mod:`benchmarks._control_plane.fleet`: the project's records, keys,
leases, liveness ports, heartbeat rates and log shipper, with a step every
``--step-time`` seconds; the plan followed by one watch of its key per
node, the agent's, which passes it on to its workers through its plan feed,
or by a ``PlanWatcher`` with ``--watch plan``; ``--watchers-per-node``
changes the count).
``--spares`` of the nodes wait as warm spares.

Measured, in this order:

1. **steady state** over ``--duration`` seconds: etcd writes/s (raft
   proposals: every put, delete, lease grant and revoke), puts/s by who wrote
   them, bytes/s from and to clients, the database size (total and in use)
   every few seconds, CPU of the controller, etcd and the fleet, and the
   latency of the reads behind ``status``, ``status`` (all jobs), ``events``
   and ``logs`` under that load;
2. the **largest request** (the largest key + value stored: what its put
   carried) and the largest range responses (the controller's per-tick reads
   and the commands' reads);
3. ``--failures`` failures of an active node, alternating two kinds:
   ``lease``: its registration lease is revoked (the node left or was cut
   off); ``crash``: the node dies (liveness port closed, lease left to
   expire) and every worker of the surviving members reports the broken
   generation.  For each: seconds from the failure to the new plan in etcd
   (seen by this process's watch), from the plan to the moment every
   simulated worker's plan watcher had it (fan-out), and to the job running
   again; then the node comes back as a spare.

``--static`` runs no fleet: it writes one snapshot of what N x W workers
hold in etcd and times the controller's tick, the commands and the recovery
record on it (:mod:`benchmarks._control_plane.static`), for N beyond what a
machine can simulate.

The targets (for 1,000 nodes x 8 workers) are checked against what was
measured and printed beside it.  The last line of stdout is one JSON object
with the headline figures (units in the names).  ``docs/control-plane.md``
has the method and the figures measured.  ``--smoke`` (:data:`SMOKE`): a fleet of 6
nodes for a 2 s window and one failure of each kind, then the static snapshot of
the same size, its figures under ``static``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.etcd.grpc_env import apply_grpc_environment  # noqa: E402

# before gRPC is imported: this process starts etcd, the controller and the fleet
apply_grpc_environment()

from agents.runtime.heartbeat import MIN_BEAT_GAP  # noqa: E402
from benchmarks._control_plane import etcd_metrics, probes  # noqa: E402
from benchmarks._control_plane.etcd_server import Etcd, running_etcd  # noqa: E402
from benchmarks._control_plane.fleet import FleetConfig, node_name  # noqa: E402
from benchmarks._control_plane.processes import (  # noqa: E402
    SAMPLE_EVERY_S,
    BenchError,
    ControllerProcess,
    PlanLog,
    Sampler,
    Slice,
    call_all,
)
from benchmarks._control_plane.report import (  # noqa: E402
    MIB,
    headline,
    print_table,
    range_note,
    targets,
)
from benchmarks._smoke import parse, result_line  # noqa: E402
from orchestrator.api import JobPhase  # noqa: E402
from orchestrator.etcd.client import EtcdClient, connect  # noqa: E402
from orchestrator.etcd.options import EtcdOptions  # noqa: E402
from orchestrator.settings import SETTINGS  # noqa: E402
from orchestrator.spec.job import JobSpec  # noqa: E402
from orchestrator.spec.loader import load_job_data  # noqa: E402
from orchestrator.state import jobs, keys, records  # noqa: E402
from orchestrator.state.records import JobStatus, Plan  # noqa: E402

JOB = "cp-bench"

#: Deadlines: every wait fails loudly past its own.
SLICE_START_S_PER_NODE = 0.2
SLICE_START_MIN_S = 60.0
JOB_START_S = 60.0
JOB_START_S_PER_NODE = 0.1
WARMUP_S = 60.0
PLAN_S = 30.0
FANOUT_S = 30.0
RECOVERY_S = 60.0
SPARE_S = 60.0
#: Rounds of command-latency probes over the steady window (and one after the failures).
PROBE_ROUNDS = 3
#: Pause between a recovery and the next failure.
FAILURE_GAP_S = 2.0
#: ``--smoke``: a fleet of 6 nodes x 2 workers, a 2 s steady window, one failure of each
#: kind; then the ``--static`` snapshot of the same size.
SMOKE = {
    "nodes": 6,
    "workers": 2,
    "spares": 2,
    "duration": 2.0,
    "step_time": 0.2,
    "heartbeat_interval": 0.5,
    "log_lines": 0.5,
    "failures": 2,
    "failure": "both",
    "lanes": 8,
    "clients": 2,
}


# ---------------------------------------------------------------------------- the run


def job_spec(args: argparse.Namespace) -> JobSpec:
    active = args.nodes - args.spares
    return load_job_data(
        {
            "name": JOB,
            # never started: the fleet stands for the workers
            "entrypoint": {"script": str(REPO / "examples" / "train_tiny.py")},
            "nodes": {"min": max(1, active // 2), "max": active, "spares": args.spares},
            "nproc_per_node": args.workers,
            "fault_tolerance": {"recovery": "in_process"},
        }
    )


def slices_for(args: argparse.Namespace, endpoints: tuple[str, ...]) -> list[FleetConfig]:
    procs = args.procs or max(1, min(4, math.ceil(args.nodes / 150)))
    per = math.ceil(args.nodes / procs)
    out = []
    for first in range(0, args.nodes, per):
        out.append(
            FleetConfig(
                endpoints=list(endpoints),
                job=JOB,
                first=first,
                count=min(per, args.nodes - first),
                workers=args.workers,
                step_time=args.step_time,
                heartbeat_interval=args.heartbeat_interval,
                node_ttl=int(SETTINGS.node_ttl.total_seconds()),
                log_lines_per_s=args.log_lines,
                lanes=args.lanes,
                clients=args.clients,
                watchers_per_node=args.watchers_per_node,
                watch=args.watch,
            )
        )
    return out


def intended_rates(args: argparse.Namespace) -> dict[str, float]:
    """What the fleet should write per second, from the project's rates."""
    active_workers = (args.nodes - args.spares) * args.workers
    spare_workers = args.spares * args.workers
    hb = args.heartbeat_interval
    active_period = min(max(args.step_time, MIN_BEAT_GAP), hb)
    return {
        "progress": active_workers / active_period + spare_workers / hb,
        "lease_refreshes": args.nodes / (SETTINGS.node_ttl.total_seconds() / 3.0),
    }


class Bench:
    """One run; fills :attr:`result`."""

    def __init__(self, args: argparse.Namespace, etcd: Etcd, tmp: Path) -> None:
        self.args = args
        self.etcd = etcd
        self.tmp = tmp
        self.result: dict[str, Any] = {}
        self.client = connect(EtcdOptions(etcd.endpoints))
        self.sampler = Sampler(etcd.urls)
        self.started = time.monotonic()
        jobs.submit(self.client, job_spec(args))
        self.plans = PlanLog(self.client, JOB)
        self.controller = ControllerProcess(etcd, JOB, tmp / "controller.log")
        self.slices = [
            Slice(cfg, tmp / f"fleet-{i}.log")
            for i, cfg in enumerate(slices_for(args, etcd.endpoints))
        ]
        self.probe_rounds: list[dict[str, dict[str, Any]]] = []
        self.broken_generation = 0

    def close(self) -> None:
        for s in self.slices:  # all at once: each takes a few seconds to stop
            if s.proc.poll() is None:
                with contextlib.suppress(BenchError):
                    s.send("stop")
        for s in self.slices:
            s.close()
        self.controller.stop()
        self.plans.cancel()
        self.sampler.stop()
        self.client.close()

    # -- helpers -----------------------------------------------------------------------

    def check(self) -> None:
        self.controller.check()
        for s in self.slices:
            if s.proc.poll() is not None:
                raise BenchError(f"fleet slice {s.name} exited ({s.proc.returncode}):\n{s.tail()}")

    def status(self) -> JobStatus | None:
        return jobs.read_status(self.client, JOB)

    def wait_status(self, ok: Callable[[JobStatus], bool], timeout: float, what: str) -> float:
        """Poll the job's status until ``ok``; returns the wall time it held."""
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            self.check()
            status = self.status()
            if status is not None and ok(status):
                return time.time()
            if status is not None and status.phase.terminal:
                break  # it will not get there
            time.sleep(0.05)
        raise BenchError(
            f"{what}: not within {timeout:g}s, or the job ended (status: "
            f"{status.phase.value if status else None}, {status.message if status else ''}); "
            f"controller log:\n{self.controller.tail()}"
        )

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f}s] {text}", flush=True)

    # -- phases ------------------------------------------------------------------------

    def start(self) -> None:
        timeout = max(SLICE_START_MIN_S, SLICE_START_S_PER_NODE * self.args.nodes)
        replies = call_all(self.slices, "start", timeout)
        setup = max(r["setup_s"] for r in replies)
        self.say(
            f"{self.args.nodes} nodes x {self.args.workers} workers registered in "
            f"{len(self.slices)} process(es), {setup:.1f}s"
        )
        at = self.wait_status(
            lambda s: s.phase is JobPhase.RUNNING,
            JOB_START_S + JOB_START_S_PER_NODE * self.args.nodes,
            "job running",
        )
        self.result["job_start_s"] = round(at - self.started_wall, 2)
        self.wait_status(lambda s: s.step >= 3, WARMUP_S, "the job at step 3")
        self.say("job running, warm")

    @property
    def started_wall(self) -> float:
        return time.time() - (time.monotonic() - self.started)

    def steady(self) -> None:
        args = self.args
        call_all(self.slices, "stats", reset=True)
        a = self.sampler.now()
        c0, t0 = self.controller.cpu_s(), time.monotonic()
        w0 = self.controller_writes()
        self.say(f"steady state for {args.duration:g}s ...")
        probe_at = [t0 + args.duration * (i + 0.5) / PROBE_ROUNDS for i in range(PROBE_ROUNDS)]
        while time.monotonic() < t0 + args.duration:
            self.check()
            if probe_at and time.monotonic() >= probe_at[0]:
                probe_at.pop(0)
                self.probe_rounds.append(
                    probes.time_commands(self.client, JOB, node_name(0), repeats=1)
                )
            time.sleep(0.2)
        b = self.sampler.now()
        c1, t1 = self.controller.cpu_s(), time.monotonic()
        fleet = call_all(self.slices, "stats", reset=True)
        if a is None or b is None:
            raise BenchError(f"etcd's metrics could not be read: {self.sampler.errors[-1:]}")
        rates = etcd_metrics.rates(a, b)
        window = t1 - t0
        counts: dict[str, float] = {}
        for f in fleet:
            for k, v in f["counts"].items():
                counts[k] = counts.get(k, 0) + v / window
        fleet_puts = sum(
            counts.get(k, 0.0) for k in ("node_progress", "log_chunks", "node_writes", "reports")
        )
        r = self.result
        r["window_s"] = round(window, 1)
        r["etcd_writes_per_s"] = round(rates["proposals_per_s"], 1)
        r["etcd_puts_per_s"] = round(rates["puts_per_s"], 1)
        r["etcd_deletes_per_s"] = round(rates["deletes_per_s"], 1)
        r["etcd_txns_per_s"] = round(rates["txns_per_s"], 1)
        r["etcd_ranges_per_s"] = round(rates["ranges_per_s"], 1)
        r["etcd_put_bytes_per_s"] = round(rates["put_bytes_per_s"])
        r["etcd_client_bytes_in_per_s"] = round(rates["client_bytes_in_per_s"])
        r["etcd_client_bytes_out_per_s"] = round(rates["client_bytes_out_per_s"])
        r["etcd_wal_bytes_per_s"] = round(rates["wal_bytes_per_s"])
        r["etcd_wal_fsync_ms_mean"] = round(rates["wal_fsync_ms_mean"], 2)
        r["etcd_backend_commit_ms_mean"] = round(rates["backend_commit_ms_mean"], 2)
        r["etcd_cpu_cores"] = round(rates["etcd_cpu_cores"], 2)
        r["etcd_grpc_per_s"] = {m: round(rates[f"grpc_{m}_per_s"], 1) for m in etcd_metrics.METHODS}
        r["controller_cpu_cores"] = round((c1 - c0) / window, 3)
        r["fleet_cpu_cores"] = round(sum(f["cpu_s"] for f in fleet) / window, 2)
        r["fleet_threads"] = sum(f["threads"] for f in fleet)
        # beats go to the node's agent, not to etcd (agents.node.progress_relay)
        r["fleet_writes_per_s"] = {
            k: round(v, 1) for k, v in sorted(counts.items()) if k != "beats"
        }
        w1 = self.controller_writes()
        r["controller_puts_per_s"] = {k: round((w1[k] - w0[k]) / window, 2) for k in sorted(w0)}
        r["other_puts_per_s"] = round(
            rates["puts_per_s"] - fleet_puts - sum(r["controller_puts_per_s"].values()), 1
        )
        intended = intended_rates(args)
        r["progress_beats_per_s_intended"] = round(intended["progress"], 1)
        r["progress_beats_per_s"] = round(counts.get("beats", 0.0), 1)
        r["node_progress_writes_per_s"] = round(counts.get("node_progress", 0.0), 1)
        r["fleet_kept_up"] = counts.get("beats", 0.0) >= 0.9 * intended["progress"]
        r["fleet_late_p99_s"] = round(max(f["late_p99_s"] for f in fleet), 3)
        r["fleet_late_max_s"] = round(max(f["late_max_s"] for f in fleet), 3)
        r["fleet_call_p50_s"] = round(max(f["call_p50_s"] for f in fleet), 4)
        r["fleet_call_p99_s"] = round(max(f["call_p99_s"] for f in fleet), 4)
        r["fleet_lease_late_max_s"] = round(max(f["lease_late_max_s"] for f in fleet), 3)
        r["fleet_errors"] = sum(f["lane_errors"] + f["counts"].get("put_errors", 0) for f in fleet)
        r["leases_lost"] = sum(f["counts"].get("leases_lost", 0) for f in fleet)
        status = self.status()
        assert status is not None
        self.weigh(status.generation)
        cost = probes.tick_cost(self.client, JOB)
        r["tick_read_ms"] = round(cost["read_ms"], 1)
        r["tick_decide_ms"] = round(cost["decide_ms"], 1)
        self.say(
            f"etcd {r['etcd_writes_per_s']:.0f} writes/s, controller "
            f"{r['controller_cpu_cores']:.2f} cores"
        )

    def controller_writes(self) -> dict[str, int]:
        """How often the controller has written its keys so far (a key's version counts its
        puts; the event log and the history grow by one key a write)."""
        status = self.client.get(keys.job_status(JOB))
        return {
            "status": status.version if status is not None else 0,
            "events": self.client.count_prefix(keys.job_events(JOB)),
            "history": self.client.count_prefix(keys.job_history(JOB)),
        }

    def weigh(self, generation: int) -> None:
        """Weigh the reads and the stored values (again after the failures: the larger counts)."""
        sizes = probes.range_sizes(self.client, JOB, generation)
        r = self.result
        before = r.get("ranges", {})
        for name, v in sizes.items():
            if name in before and before[name]["bytes"] > v["bytes"]:
                sizes[name] = before[name]
        r["ranges"] = sizes
        largest = max(sizes.values(), key=lambda v: v["largest"])
        r["largest_request_bytes"] = largest["largest"]
        r["largest_request_key"] = largest["largest_key"].removeprefix(keys.job_prefix(JOB))
        controller = {k: v for k, v in sizes.items() if k.startswith("controller:")}
        r["largest_controller_range_bytes"] = max(v["bytes"] for v in controller.values())
        commands = {k: v for k, v in sizes.items() if not k.startswith("controller:")}
        r["largest_command_range_bytes"] = max(v["bytes"] for v in commands.values())

    def failures(self) -> None:
        records_: list[dict[str, Any]] = []
        modes = ("lease", "crash") if self.args.failure == "both" else (self.args.failure,)
        for k in range(self.args.failures):
            records_.append(self.one_failure(modes[k % len(modes)], k))
            time.sleep(FAILURE_GAP_S)
        self.result["failures"] = records_
        for key in (
            "failure_to_plan_s",
            "plan_to_seen_s",
            "failure_to_seen_s",
            "failure_to_running_s",
        ):
            values = [f[key] for f in records_]
            self.result[f"{key}_median"] = round(statistics.median(values), 3) if values else None
            self.result[f"{key}_max"] = round(max(values), 3) if values else None

    def one_failure(self, mode: str, k: int) -> dict[str, Any]:
        status = self.status()
        assert status is not None
        old = status.generation
        plan = self.plans.seen[-1][1]
        # an active member away from rank 0, a different one each time
        victim = plan.members[(len(plan.members) // 2 + 7 * k) % len(plan.members)].node
        owner = next(s for s in self.slices if s.owns(victim))
        call_all(self.slices, "arm", on=True)
        log_from = self.controller.log_size()
        if mode == "lease":
            failed_at = owner.call("revoke", node=victim)["at"]
        else:
            failed_at = owner.call("crash", node=victim)["at"]
            self.broken_generation = old
            call_all(self.slices, "break", generation=old, reason=f"{victim} is gone (simulated)")
        plan_at, new, revision = self.plans.wait_newer(old, PLAN_S, self.check)
        seen: dict[str, float] = {}
        reported: list[float] = []
        for reply in call_all(
            self.slices, "collect", FANOUT_S + 5, revision=revision, within=FANOUT_S
        ):
            reported += reply["reported"]
            if reply["missing"]:
                raise BenchError(
                    f"{len(reply['missing'])} node(s) never saw generation {new.generation} "
                    f"within {FANOUT_S:g}s: {reply['missing'][:10]}"
                )
            seen.update(reply["seen"])
        call_all(self.slices, "arm", on=False)
        running_at = self.wait_status(
            lambda s: s.phase is JobPhase.RUNNING and s.generation >= new.generation,
            RECOVERY_S,
            f"the job running again in generation {new.generation}",
        )
        last_seen = max(seen.values())
        # the plan's first sight anywhere: this process's watch or a node's, whichever
        # came first (a node's watch may see it a moment before this one does)
        plan_at = min(plan_at, *seen.values())
        out = {
            "mode": mode,
            "node": victim,
            "generation": new.generation,
            "reason": new.reason,
            "failure_to_plan_s": round(plan_at - failed_at, 3),
            "plan_to_seen_s": round(last_seen - plan_at, 3),
            "failure_to_seen_s": round(last_seen - failed_at, 3),
            "failure_to_running_s": round(running_at - failed_at, 3),
            "nodes_seen": len(seen),
            # the controller's liveness probes of the silent members: (how many, seconds)
            "probe_rounds": self.controller.probe_rounds(log_from),
        }
        if mode == "crash" and reported:  # when the survivors' reports were written
            out["failure_to_first_report_s"] = round(min(reported) - failed_at, 3)
            out["failure_to_last_report_s"] = round(max(reported) - failed_at, 3)
        detail = ""
        if "failure_to_last_report_s" in out:
            probed = ", ".join(f"{n} in {s:.2f}s" for n, s in out["probe_rounds"])
            detail = (
                f" (reports written {out['failure_to_first_report_s']:.2f}-"
                f"{out['failure_to_last_report_s']:.2f}s after it; probed {probed or 'none'})"
            )
        self.say(
            f"{mode} of {victim}: plan {out['failure_to_plan_s']:.2f}s after it{detail}, seen "
            f"by every worker {out['plan_to_seen_s']:.2f}s later, running again after "
            f"{out['failure_to_running_s']:.2f}s"
        )
        owner.call("revive", node=victim)
        self.wait_status(lambda s: victim in s.spare_nodes, SPARE_S, f"{victim} back as a spare")
        return out

    def finish(self) -> None:
        self.result["plan_decode_ms"] = round(plan_decode_ms(self.client), 2)
        # the reports the controller read after the last crash: every survivor's
        self.weigh(self.broken_generation)
        self.probe_rounds.append(probes.time_commands(self.client, JOB, node_name(0), repeats=1))
        self.result["commands"] = probes.merge(self.probe_rounds)
        self.sampler.stop()
        self.db_trend()
        self.result["controller_errors"] = self.controller.errors()
        self.result["total_runtime_s"] = round(time.monotonic() - self.started, 1)

    def db_trend(self) -> None:
        scrapes = self.sampler.scrapes
        series = [(s.at - self.started, etcd_metrics.sizes(s)) for s in scrapes]
        r = self.result
        totals = [v["db_total_bytes"] for _, v in series]
        in_use = [v["db_in_use_bytes"] for _, v in series]
        r["db_samples"] = [
            [round(t, 1), round(v["db_total_bytes"] / MIB, 2), round(v["db_in_use_bytes"] / MIB, 2)]
            for t, v in series
        ]
        # one sample a minute (and the last) for the JSON line: the size over the run
        step = max(1, round(60 / SAMPLE_EVERY_S))
        picked = r["db_samples"][::step]
        if picked[-1] is not r["db_samples"][-1]:
            picked.append(r["db_samples"][-1])
        r["db_mib_by_minute"] = picked
        r["db_total_mib_start"] = round(totals[0] / MIB, 2)
        r["db_total_mib_end"] = round(totals[-1] / MIB, 2)
        r["db_total_mib_max"] = round(max(totals) / MIB, 2)
        r["db_in_use_mib_end"] = round(in_use[-1] / MIB, 2)
        half = series[len(series) // 2 :]
        r["db_total_growth_mib_per_min"] = round(_slope(half, "db_total_bytes") * 60 / MIB, 3)
        r["db_in_use_growth_mib_per_min"] = round(_slope(half, "db_in_use_bytes") * 60 / MIB, 3)
        last = series[-1][1]
        r["etcd_keys"] = int(last["keys"])
        r["etcd_watchers"] = int(last["watchers"])
        r["etcd_slow_watchers"] = int(last["slow_watchers"])
        r["compacted"] = last["compact_revision"] > 0
        # what a periodic compaction keeps at a retention: every revision written within it
        per_rev = r["etcd_put_bytes_per_s"] + 64 * (r["etcd_puts_per_s"] + r["etcd_deletes_per_s"])
        r["db_mib_kept_per_hour_of_retention"] = round(per_rev * 3600 / MIB, 1)


def plan_decode_ms(client: EtcdClient, repeats: int = 5) -> float:
    """Milliseconds a worker's plan watcher spends decoding the current plan (each worker
    does it in its own process; a fleet process does it once per watcher, in turn)."""
    kv = client.get(keys.job_plan(JOB))
    if kv is None:
        return 0.0
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        records.decode(Plan, kv.value, kv.key)
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def _slope(series: list[tuple[float, dict[str, float]]], name: str) -> float:
    """Least-squares slope of ``name`` over time (per second)."""
    if len(series) < 2:
        return 0.0
    ts = [t for t, _ in series]
    vs = [v[name] for _, v in series]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den if den else 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100, help="simulated nodes, spares included")
    p.add_argument("--workers", type=int, default=8, help="workers per node")
    p.add_argument("--duration", type=float, default=60.0, help="steady-state window, seconds")
    p.add_argument("--cluster", type=int, choices=(1, 3), default=1, help="etcd members")
    p.add_argument("--failures", type=int, default=2, help="node failures to time")
    p.add_argument(
        "--failure",
        choices=("lease", "crash", "both"),
        default="both",
        help="kind of failure (both: alternate)",
    )
    p.add_argument("--spares", type=int, default=2, help="nodes waiting as warm spares")
    p.add_argument("--step-time", type=float, default=1.0, help="seconds per training step")
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=2.0,
        help="fault_tolerance.heartbeat_interval (the spec's default)",
    )
    p.add_argument(
        "--log-lines", type=float, default=0.1, help="lines of output per worker per second"
    )
    p.add_argument(
        "--compaction",
        default="",
        help="etcd --auto-compaction-retention: revisions (revision mode) or a duration such"
        " as 1m (periodic mode); default: the product's, revision mode, the newest 10,000",
    )
    p.add_argument("--procs", type=int, default=0, help="fleet processes (0: 1 per 150 nodes)")
    p.add_argument("--lanes", type=int, default=128, help="threads per fleet process for writes")
    p.add_argument("--clients", type=int, default=16, help="etcd connections per fleet process")
    p.add_argument(
        "--watch",
        choices=("plan", "raw"),
        default="raw",
        help="plan: a PlanWatcher per watcher (it decodes every plan: in one process that "
        "is serial, a real node's workers do it in parallel); raw: a bare watch of the plan "
        "key per watcher (etcd's fan-out alone)",
    )
    p.add_argument(
        "--watchers-per-node",
        type=int,
        default=1,
        help="plan watchers per node (1: as a real node: the agent watches the plan "
        "and passes it to its workers through its plan feed; workers + 1: as a node did "
        "before the feed, one per worker and the agent's)",
    )
    p.add_argument(
        "--static",
        action="store_true",
        help="no fleet: write one snapshot of N x W workers' records and time the "
        "controller's tick and the commands' reads on it (for N beyond what can be simulated)",
    )
    args = parse(p, SMOKE, argv)
    if args.spares >= args.nodes:
        p.error(f"--spares ({args.spares}) must be fewer than --nodes ({args.nodes})")
    if args.watchers_per_node < 1:
        p.error(f"--watchers-per-node must be 1 or more, not {args.watchers_per_node}")
    return args


def run_static(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """``--static``: one snapshot of N x W workers, the controller's tick and the reads on
    it; prints them and returns the figures of its JSON line."""
    from benchmarks._control_plane import static

    result["mode"] = "static"
    with running_etcd(args.cluster, args.compaction) as etcd:
        client = connect(EtcdOptions(etcd.endpoints))
        try:
            spec = job_spec(args)
            jobs.submit(client, spec)
            started = time.monotonic()
            result.update(static.snapshot(client, spec, args.nodes, args.spares))
            result["snapshot_write_s"] = round(time.monotonic() - started, 1)
            result.update(static.tick_repeated(client, JOB, repeats=3))
            result.update(static.report_burst(client, JOB, args.nodes, args.workers))
            broken = static.tick_repeated(client, JOB, repeats=3)
            result.update({f"{k}_in_break": v for k, v in broken.items()})
            sizes = probes.range_sizes(client, JOB, 2)
            result["commands"] = probes.merge([probes.time_commands(client, JOB, node_name(0))])
            result["plan_decode_ms"] = round(plan_decode_ms(client), 2)
        finally:
            client.close()
    print(f"\ncontrol plane, static snapshot: {args.nodes} nodes x {args.workers} workers")
    for name, v in sizes.items():
        note = range_note(v["bytes"])
        print(f"  range {name:<24} {v['keys']:>8,} keys {v['bytes']:>12,} B{note}")
        result[f"range_bytes_{name.replace(':', '_')}"] = v["bytes"]
    for key in (
        "tick_read_ms",
        "tick_decide_ms",
        "tick_error",
        "report_burst_puts",
        "report_burst_s",
        "tick_read_ms_in_break",
        "tick_decide_ms_in_break",
        "plan_decode_ms",
        "plan_bytes",
        "recovery_record_bytes",
        "recovery_record_refused",
    ):
        if key in result:
            print(f"  {key:<30} {result[key]}")
    for name, c in result.pop("commands").items():
        print(f"  {name:<30} {c['median_ms']} ms {c['error'][:80]}")
        result[f"{name}_ms_median"] = c["median_ms"]
        if c["error"]:
            result[f"{name}_error"] = c["error"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "workers": args.workers,
        "cluster": args.cluster,
        "step_time_s": args.step_time,
        "duration_s": args.duration,
        "compaction_retention": args.compaction,
        "log_lines_per_worker_s": args.log_lines,
        "watch": args.watch,
        "watchers_per_node": args.watchers_per_node,
    }
    if args.static:
        print(result_line(run_static(args, result), args.smoke, sort_keys=True))
        return 0
    error = ""
    with (
        tempfile.TemporaryDirectory(prefix="rm-control-plane-") as tmp,
        running_etcd(args.cluster, args.compaction) as etcd,
    ):
        bench = Bench(args, etcd, Path(tmp))
        try:
            bench.start()
            bench.steady()
            bench.failures()
            bench.finish()
        except BenchError as e:
            error = str(e)
            bench.result["controller_errors"] = bench.controller.errors()
            print(f"error: {error}\netcd logs:\n{etcd.log_tails()}", file=sys.stderr, flush=True)
        finally:
            bench.close()
        result.update(bench.result)
    if error:
        result["error"] = error.splitlines()[0][:500]
        print(result_line(result, args.smoke, sort_keys=True))
        return 1
    result["targets"] = targets(result)
    print_table(result, sys.stdout)
    line = headline(result)
    if args.smoke:  # the static snapshot too, its figures under "static"
        line["static"] = run_static(argparse.Namespace(**{**vars(args), "static": True}), {})
    print(result_line(line, args.smoke, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
