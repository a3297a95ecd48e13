"""The control-plane benchmark's verdicts and output: the targets, the table, the JSON line."""

from __future__ import annotations

import math
from typing import IO, Any

from orchestrator.etcd.ranges import PAGE_BYTES

MIB = 1024 * 1024

#: The issue's targets at 1,000 nodes x 8 workers.
TARGET_PLAN_S = 2.0
TARGET_SEEN_S = 3.0
TARGET_WRITES_PER_S = 2000.0
TARGET_DB_MIB = 256.0
TARGET_REQUEST_BYTES = MIB
TARGET_CONTROLLER_CORES = 1.0
#: "Flat": the database grows by less than this over the second half of the window.
FLAT_MIB_PER_MIN = 1.0
#: gRPC's default receive limit, which the project's etcd client keeps.
GRPC_RECEIVE_LIMIT = 4 * MIB


def range_note(size: int) -> str:
    """What a range read of ``size`` bytes in all costs a client: one response, or pages
    (the client reads every range in pages of about ``PAGE_BYTES``, at one revision)."""
    if size <= PAGE_BYTES:
        return ""
    pages = math.ceil(size / PAGE_BYTES)
    whole = "over" if size > GRPC_RECEIVE_LIMIT else "under"
    return f"  read in ~{pages} pages of <= 1 MiB (whole, {whole} gRPC's 4 MiB)"


def targets(r: dict[str, Any]) -> dict[str, bool | None]:
    """Each target of the issue, met or not (None: not measured)."""
    return {
        "failure_to_plan_under_2s": _under(r.get("failure_to_plan_s_max"), TARGET_PLAN_S),
        "seen_by_every_worker_under_3s": _under(r.get("failure_to_seen_s_max"), TARGET_SEEN_S),
        "writes_under_2000_per_s": _under(r.get("etcd_writes_per_s"), TARGET_WRITES_PER_S),
        "db_flat": _under(r.get("db_total_growth_mib_per_min"), FLAT_MIB_PER_MIN),
        "db_under_256mib": _under(r.get("db_total_mib_max"), TARGET_DB_MIB),
        "requests_under_1mib": _under(r.get("largest_request_bytes"), TARGET_REQUEST_BYTES),
        "controller_under_one_core": _under(r.get("controller_cpu_cores"), TARGET_CONTROLLER_CORES),
    }


def _under(value: float | None, limit: float) -> bool | None:
    return None if value is None else value < limit


def print_table(r: dict[str, Any], out: IO[str]) -> None:
    def row(name: str, value: Any, unit: str = "", target: str = "") -> None:
        text = f"{value:,.3f}".rstrip("0").rstrip(".") if isinstance(value, float) else f"{value}"
        print(f"  {name:<44} {text + (' ' + unit if unit else ''):>22}  {target}", file=out)

    met = r["targets"]

    def mark(key: str) -> str:
        return {True: "ok", False: "MISSED", None: "-"}[met[key]]

    print(
        f"\ncontrol plane: {r['nodes']} nodes x {r['workers']} workers, "
        f"{r['cluster']}-member etcd, step {r['step_time_s']:g}s, "
        f"window {r.get('window_s')}s",
        file=out,
    )
    print("steady state", file=out)
    row(
        "etcd writes (raft proposals)",
        r["etcd_writes_per_s"],
        "/s",
        f"target < {TARGET_WRITES_PER_S:,.0f}: {mark('writes_under_2000_per_s')}",
    )
    row(
        "  puts / deletes / txns",
        f"{r['etcd_puts_per_s']:,.0f} / {r['etcd_deletes_per_s']:,.0f}"
        f" / {r['etcd_txns_per_s']:,.0f}",
        "/s",
    )
    for kind, rate in r["fleet_writes_per_s"].items():
        row(f"  fleet: {kind}", rate, "/s")
    for kind, rate in r["controller_puts_per_s"].items():
        row(f"  controller: {kind}", rate, "/s")
    row("  others (the rest)", r["other_puts_per_s"], "/s")
    row(
        "progress beats (to the agents): made / intended",
        f"{r['progress_beats_per_s']:,.0f} / {r['progress_beats_per_s_intended']:,.0f}",
        "/s",
        "fleet kept up" if r["fleet_kept_up"] else "FLEET FELL BEHIND",
    )
    if r["leases_lost"]:
        print(
            f"  ! the fleet lost {r['leases_lost']} leases (its keep-alives fell up to "
            f"{r['fleet_lease_late_max_s']:g}s behind): nodes left and came back meanwhile",
            file=out,
        )
    row(
        "etcd bytes in / out (clients)",
        f"{r['etcd_client_bytes_in_per_s'] / 1e6:,.2f} / "
        f"{r['etcd_client_bytes_out_per_s'] / 1e6:,.2f}",
        "MB/s",
    )
    row("etcd put payload", r["etcd_put_bytes_per_s"] / 1e6, "MB/s")
    row("etcd ranges", r["etcd_ranges_per_s"], "/s")
    row(
        "CPU: controller",
        r["controller_cpu_cores"],
        "cores",
        f"target < 1: {mark('controller_under_one_core')}",
    )
    row("CPU: etcd / fleet", f"{r['etcd_cpu_cores']} / {r['fleet_cpu_cores']}", "cores")
    row(
        "controller tick: read world / decide", f"{r['tick_read_ms']} / {r['tick_decide_ms']}", "ms"
    )
    row(
        "etcd WAL fsync / backend commit (mean)",
        f"{r['etcd_wal_fsync_ms_mean']} / {r['etcd_backend_commit_ms_mean']}",
        "ms",
    )
    print("database", file=out)
    row(
        "total: start / end / max",
        f"{r['db_total_mib_start']} / {r['db_total_mib_end']} / {r['db_total_mib_max']}",
        "MiB",
        f"target < 256: {mark('db_under_256mib')}",
    )
    row(
        "growth, second half (total / in use)",
        f"{r['db_total_growth_mib_per_min']} / {r['db_in_use_growth_mib_per_min']}",
        "MiB/min",
        f"flat: {mark('db_flat')}",
    )
    row("kept per hour of compaction retention", r["db_mib_kept_per_hour_of_retention"], "MiB")
    row("keys / watchers", f"{r['etcd_keys']:,} / {r['etcd_watchers']:,}")
    by_minute = ", ".join(f"{total:g}" for _, total, _ in r["db_mib_by_minute"])
    print(f"  total MiB, a sample a minute: {by_minute}", file=out)
    print("sizes", file=out)
    row(
        f"largest request: {r['largest_request_key']}",
        r["largest_request_bytes"],
        "B",
        f"target < 1 MiB: {mark('requests_under_1mib')}",
    )
    for name, v in r["ranges"].items():
        row(f"  range {name} ({v['keys']:,} keys)", v["bytes"], "B", range_note(v["bytes"]))
    print("failures", file=out)
    for f in r.get("failures", []):
        row(
            f"  {f['mode']} of {f['node']}: plan / seen / running",
            f"{f['failure_to_plan_s']:.2f} / {f['failure_to_seen_s']:.2f} / "
            f"{f['failure_to_running_s']:.2f}",
            "s",
        )
    row(
        "failure -> plan (max)",
        r.get("failure_to_plan_s_max"),
        "s",
        f"target < 2: {mark('failure_to_plan_under_2s')}",
    )
    row("plan -> every worker (max)", r.get("plan_to_seen_s_max"), "s")
    row(
        "failure -> every worker (max)",
        r.get("failure_to_seen_s_max"),
        "s",
        f"target < 3: {mark('seen_by_every_worker_under_3s')}",
    )
    print("commands (reads under load)", file=out)
    for name, c in r["commands"].items():
        row(f"  {name}: median / max", f"{c['median_ms']} / {c['max_ms']}", "ms", c["error"][:60])


def headline(r: dict[str, Any]) -> dict[str, Any]:
    """The JSON line: everything but the long series and per-range details."""
    out = {k: v for k, v in r.items() if k not in ("db_samples", "ranges", "commands")}
    for name, c in r.get("commands", {}).items():
        out[f"{name}_ms_median"] = c["median_ms"]
        out[f"{name}_ms_max"] = c["max_ms"]
        if c["error"]:
            out[f"{name}_error"] = c["error"]
    for name, v in r.get("ranges", {}).items():
        out[f"range_bytes_{name.replace(':', '_')}"] = v["bytes"]
    return out
