"""Recovery at real state sizes: an in-process hot-swap whose state transfer is the work.

For each size given (``--sizes 0.1 0.5 1 2``, decimal GB of total state:
parameters, Adam's two moments and an EMA copy of the parameters, all fp32;
``examples/train_wide.py``), one job runs on 127.0.0.1 as ``recovery.py``
runs its in-process row: ``LocalRun`` with 2 active nodes (``--nodes``: a row
for each count given) and 1 warm spare, one active node (agent and worker)
SIGKILLed once the job has completed ``KILL_AT`` steps.  The spare's worker
receives the whole state from the survivor; with two survivors or more, each
sends it a share of the model and optimizer (whole tensors, balanced by bytes)
and the first the rest, all at once.  Once the recovery record is written
(the new generation completed a step) the job's processes are ended: it has
no end of its own and saves nothing.  One compute thread per worker
(``OMP_NUM_THREADS=1``): the workers share the machine's cores.  Per size:

* seconds from the SIGKILL to the next completed step of the new generation,
  split into the recovery record's phases (the controller's
  ``recoveries/<run>-<gen>`` record): detect (from the kill to the new plan),
  rendezvous (to the last worker's process group), restore (to the last
  worker's state loaded: capture, transfer and load), first step;
* bytes moved: the tracked state's tensor bytes as the training script counts
  them (the runtime's telemetry records no byte count for this path; the RNG
  state, 5 KB, and the pickled structure travel beside them);
* heal throughput: those bytes over the restore phase;
* the limit, measured in the same run around the job
  (:mod:`_wire_limit`): one gloo ``send``/``recv`` of the same number of
  bytes as one flat tensor, and one raw socket copy, between two fresh
  processes on 127.0.0.1, the fastest of ``--limit-rounds`` (half of them
  before the job, the rest after it: a load that drifts on a shared machine
  weighs on both sides of the ratio); the heal's throughput as a share of each;
* the peak resident memory (``VmHWM``) of the sender (the survivor) and of
  the receiver (the spare's worker) from their last step before the heal to
  their first step after it, against the state's size, also without the
  process's memory before it built the model (the interpreter, torch, the
  runtime); and the survivor's last step before the failure, beside the first
  step after it.

With ``--checksum`` the survivor and the receiver digest their state (its
structure and its data) as the new generation starts, and each row says
whether the receiver's equals the sender's (the digests take time: they
inflate the first-step phase).  A size whose job could not fit in the memory
available now (about ``MEMORY_FACTOR`` times the state, see
:func:`memory_needed`) is left out, with the reason.

The last line is one JSON object: a row per size, the units, the targets.

Usage: ``python benchmarks/recovery_at_size.py [--sizes 0.1 0.5 1 2] [--checksum]``;
``--smoke``: 2 MB of state in 2 layers, checksums on, one transfer per transport.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.etcd.grpc_env import apply_grpc_environment  # noqa: E402

# before gRPC is imported: this process forks agents (see orchestrator.etcd.grpc_env)
apply_grpc_environment()

import _wire_limit  # noqa: E402
from _state_at_size import skipped_for_memory  # noqa: E402

from benchmarks._smoke import parse, result_line  # noqa: E402

#: The step after which an active node is killed; the job runs until its recovery
#: record is written (the new generation completed a step), then its processes go.
KILL_AT = 3
#: Steps the job may run at most (it is stopped long before), and how long it may take.
MAX_STEPS = 100_000
JOB_PATIENCE_S = 900.0
#: Memory a size needs, in states: two active workers with gradients, DDP's
#: buckets and what the allocator keeps (up to 2.5 states each, seen at 0.5 GB),
#: and the spare's model and EMA (0.5); after the kill, the survivor's copy of
#: its state while it sends (1) and the receiver's buffer (1) fit in what the
#: killed worker held.
MEMORY_FACTOR = 5.5
#: Memory left to the rest of the machine (etcd, agents, the controller, others).
MEMORY_SPARE_BYTES = 2 << 30
UNITS = {
    "state_gb": "10^9 bytes",
    "_bytes": "bytes",
    "_s": "seconds",
    "_mb_per_s": "10^6 bytes per second",
    "ratio": "heal throughput / the limit's, or peak resident memory / state bytes",
}
TARGETS = {
    "heal_ratio_to_gloo_at_1_and_2_gb": 0.8,
    "peak_rss_over_state_at_most": 1.25,
}


#: ``--smoke``: the least state, its digests compared, one transfer per transport.
SMOKE = {"sizes": [0.002], "layers": 2, "limit_rounds": 1, "checksum": True}


def memory_needed(state_bytes: float, nodes: int = 2) -> int:
    """Bytes a job of ``state_bytes`` on ``nodes`` active nodes needs free (see
    :data:`MEMORY_FACTOR`; each active node past two adds 2.5 states)."""
    return int((MEMORY_FACTOR + 2.5 * (nodes - 2)) * state_bytes) + MEMORY_SPARE_BYTES


def run_heal(
    tmp: Path, size_gb: float, layers: int, checksum: bool, verbose: bool = False, nodes: int = 2
) -> dict[str, Any]:
    """One job at ``size_gb``: kill a node, read the recovery record and the workers'
    reports.  Returns the row's heal figures (no limit yet)."""
    from orchestrator.local_run import LocalRun
    from orchestrator.observe.records import RecoveryRecord
    from orchestrator.spec.loader import load_job_data
    from orchestrator.state import jobs, keys, records

    reports = tmp / "reports"
    args = ["--state-gb", str(size_gb), "--layers", str(layers), "--report", str(reports)]
    spec = load_job_data(
        {
            "name": f"heal-{str(size_gb).replace('.', '-')}-{nodes}",
            "entrypoint": {
                "script": str(REPO / "examples" / "train_wide.py"),
                "args": [*args, *(["--checksum"] if checksum else [])],
                "env": {"OMP_NUM_THREADS": "1"},
            },
            "nodes": {"min": nodes, "max": nodes, "spares": 1},
            "max_steps": MAX_STEPS,
            # nothing is saved; a job never resumes from a checkpoint another one left
            "checkpoint": {"url": f"file://{tmp}/checkpoints"},
        }
    )
    lines: list[str] = []
    printer = (lambda line: print(line, flush=True)) if verbose else lines.append
    run = LocalRun(spec, printer=printer, workdir=str(REPO))
    run.start()
    try:
        killed_at = 0.0
        deadline = time.time() + JOB_PATIENCE_S
        while time.time() < deadline:
            status = jobs.read_status(run.client, spec.name)
            if status and status.step >= KILL_AT and status.active_nodes:
                killed_at = time.time()
                run.kill_node(status.active_nodes[0])
                break
            time.sleep(0.01)
        found: dict[str, RecoveryRecord] = {}
        while killed_at and time.time() < deadline:
            # written once every worker of the new generation completed a step
            found = records.read_all(run.client, keys.job_recoveries(spec.name), RecoveryRecord)
            if found:
                break
            time.sleep(0.1)
    finally:
        # the job has no end of its own and what it measured is written: its processes
        # go without a stop's save (a few seconds and a state's worth of disk per size)
        run.stop(grace=0.0)
    assert killed_at and len(found) == 1, f"{len(found)} recovery records\n" + "\n".join(
        lines[-40:]
    )
    record = next(iter(found.values()))
    figures = [json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))]
    return _heal_figures(size_gb, killed_at, record, figures)


def _heal_figures(
    size_gb: float, killed_at: float, record: Any, figures: list[dict[str, Any]]
) -> dict[str, Any]:
    """The row's heal half from the recovery record and the workers' reports."""

    def heal_of(report: dict[str, Any]) -> dict[str, Any] | None:
        return next((h for h in report["heals"] if h["generation"] == record.generation), None)

    healed = [(r, h) for r in figures if (h := heal_of(r)) is not None]
    receivers = [(r, h) for r, h in healed if r["generations"][0] == record.generation]
    senders = [(r, h) for r, h in healed if r["generations"][0] < record.generation]
    assert len(receivers) == 1 and senders, (
        f"expected survivors and one receiver in generation {record.generation}: {figures}"
    )
    # the first survivor's figures (rank order): with two or more, each sent a share
    (receiver, r_heal), (sender, s_heal) = receivers[0], senders[0]
    phases = record.phases
    state = int(sender["state_bytes"])
    row: dict[str, Any] = {
        "state_gb": size_gb,
        "parameters": sender["parameters"],
        "width": sender["width"],
        "layers": sender["layers"],
        "state_bytes": state,
        "survivors": len(senders),
        "receiver_state_bytes": int(receiver["state_bytes"]),
        "bytes_moved": state,
        "bytes_moved_from": "the tracked state's tensor bytes (not counted on the wire)",
        "next_step_s": record.first_step_at - killed_at,
        "detect_s": record.declared_at - killed_at,
        "rendezvous_s": phases["rendezvous"],
        "restore_s": phases["restore"],
        "first_step_s": phases["first_step"],
        # the survivor's last step before the failure: what a step costs anyway
        "step_before_s": s_heal.get("last_step_s"),
        "record_total_s": record.total_s,
        "cause": record.cause,
        "heal_mb_per_s": state / phases["restore"] / 1e6 if phases["restore"] > 0 else None,
        "step": record.step,
        "restored_step": record.restored_step,
    }
    # the receiver's load after the sender was done (each worker's own restored_at)
    worker_times = record.workers
    s_t, r_t = worker_times.get(sender["worker"], {}), worker_times.get(receiver["worker"], {})
    if s_t.get("restored_at") and r_t.get("restored_at"):
        row["sender_restored_s"] = float(s_t["restored_at"]) - record.group_formed_at
        row["receiver_after_sender_s"] = float(r_t["restored_at"]) - float(s_t["restored_at"])
    for name, report, heal in (("sender", sender, s_heal), ("receiver", receiver, r_heal)):
        peak, before = heal["peak_rss_bytes"], heal["rss_before_bytes"]
        baseline = report["rss_baseline_bytes"]
        row[f"{name}_peak_rss_bytes"] = peak
        row[f"{name}_rss_before_bytes"] = before
        row[f"{name}_rss_baseline_bytes"] = baseline
        row[f"{name}_peak_over_state"] = peak / state if peak else None
        # without the process's own memory (interpreter, torch, runtime): the state and
        # what the heal added to it, the figure the 1.25 x target is about
        row[f"{name}_peak_less_baseline_over_state"] = (
            (peak - baseline) / state if peak and baseline else None
        )
    if "data_sha256" in s_heal:
        row["structure_equal"] = s_heal["structure_sha256"] == r_heal["structure_sha256"]
        row["data_equal"] = s_heal["data_sha256"] == r_heal["data_sha256"]
    return row


def add_limit(row: dict[str, Any], measured: list[dict[str, list[dict[str, Any]]]]) -> None:
    """Put the wire's limit (the fastest transfer of each transport: interference on a
    shared machine only ever slows one down) and the heal's ratios to it into ``row``."""
    for transport in ("gloo", "socket"):
        done = [t for m in measured for t in m[transport]]
        best = max(done, key=lambda t: t["mb_per_s"])
        row[f"{transport}_limit_s"] = best["seconds"]
        row[f"{transport}_limit_mb_per_s"] = best["mb_per_s"]
        row[f"{transport}_limit_mb_per_s_rounds"] = [round(t["mb_per_s"], 1) for t in done]
        row[f"{transport}_limit_receiver_peak_rss_bytes"] = best["receiver_peak_rss_bytes"]
        heal = row["heal_mb_per_s"]
        row[f"heal_ratio_to_{transport}"] = heal / best["mb_per_s"] if heal else None


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def _print_row(row: dict[str, Any]) -> None:
    if "skipped" in row:
        print(f"{row['state_gb']:g} GB: not run: {row['skipped']}", flush=True)
        return
    mb = row["bytes_moved"] / 1e6
    print(
        f"{row['state_gb']:g} GB, {row['survivors']} survivor(s) "
        f"({mb:.1f} MB moved, computed from the state): "
        f"{row['next_step_s']:.2f}s to the next step = detect {row['detect_s']:.2f}s + "
        f"rendezvous {row['rendezvous_s']:.2f}s + restore {row['restore_s']:.2f}s + "
        f"first step {row['first_step_s']:.2f}s"
        + (f" (a step before: {row['step_before_s']:.2f}s)" if row["step_before_s"] else ""),
        flush=True,
    )
    print(
        f"    heal {row['heal_mb_per_s']:.0f} MB/s = {row['heal_ratio_to_gloo']:.2f} of gloo "
        f"send/recv ({row['gloo_limit_mb_per_s']:.0f} MB/s), "
        f"{row['heal_ratio_to_socket']:.2f} of a raw socket "
        f"({row['socket_limit_mb_per_s']:.0f} MB/s)",
        flush=True,
    )
    parts = []
    for name in ("sender", "receiver"):
        peak = row[f"{name}_peak_rss_bytes"]
        if peak is None:
            parts.append(f"{name} not measured")
            continue
        less = row[f"{name}_peak_less_baseline_over_state"]
        parts.append(
            f"{name} {peak / 1e6:.0f} MB = {row[f'{name}_peak_over_state']:.2f} x state"
            + (
                f" ({less:.2f} x without its {row[f'{name}_rss_baseline_bytes'] / 1e6:.0f} MB "
                "before the model)"
                if less is not None
                else ""
            )
        )
    print(f"    peak resident memory, heal: {'; '.join(parts)}", flush=True)
    if "data_equal" in row:
        print(
            f"    the receiver's state equals the sender's: structure {row['structure_equal']}, "
            f"data {row['data_equal']}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=float, nargs="+", default=[0.1], help="total state, 10^9 bytes each"
    )
    parser.add_argument("--layers", type=int, default=4, help="square Linear layers of the model")
    parser.add_argument(
        "--limit-rounds", type=int, default=2, help="transfers per transport (at least 1)"
    )
    parser.add_argument(
        "--checksum", action="store_true", help="compare the receiver's state with the sender's"
    )
    parser.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        default=[2],
        help="active nodes of each job (a row each; the survivors of 3 or more each send "
        "the spare a share of the model and optimizer)",
    )
    parser.add_argument("--verbose", action="store_true", help="print the jobs' output")
    args = parse(parser, SMOKE)
    rows: list[dict[str, Any]] = []
    for size, nodes in [(size, n) for size in args.sizes for n in args.nodes]:
        skipped = skipped_for_memory(size, memory_needed(size * 1e9, nodes))
        if skipped is not None:
            row: dict[str, Any] = skipped
        else:
            # the limit's rounds bracket the heal: half before it (at the nominal size),
            # the rest after it (at the bytes it moved)
            before = _wire_limit.transfers(int(size * 1e9), args.limit_rounds // 2)
            with tempfile.TemporaryDirectory() as tmp:
                row = run_heal(Path(tmp), size, args.layers, args.checksum, args.verbose, nodes)
            after = _wire_limit.transfers(
                row["bytes_moved"], args.limit_rounds - args.limit_rounds // 2
            )
            add_limit(row, [before, after])
        row = _rounded(row)
        _print_row(row)
        rows.append(row)
    print(
        result_line(
            {
                "sizes_gb": args.sizes,
                "nodes": args.nodes,
                "spares": 1,
                "transport": "gloo on 127.0.0.1",
                "checksum": args.checksum,
                "rows": rows,
                "units": UNITS,
                "targets": TARGETS,
            },
            args.smoke,
        )
    )


if __name__ == "__main__":
    main()
