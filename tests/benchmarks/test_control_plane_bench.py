"""The control-plane benchmark in its short form: 50 simulated nodes x 8 workers.

``benchmarks/control_plane.py`` runs a real etcd, the real controller and the
simulated fleet; here it runs briefly and its JSON line is checked for what
the benchmark exists to report: etcd's rates and size, the controller's CPU,
a new plan after each kind of node failure, and every worker seeing it.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.benchmarks.runner import run_benchmark

# a benchmark's short run with its figures checked: `make bench-smoke` (CI runs it beside make test)
pytestmark = [pytest.mark.bench_smoke, pytest.mark.timeout(240)]

NODES, WORKERS = 50, 8


def _bench(args: list[str]) -> tuple[dict[str, Any], str]:
    return run_benchmark("control_plane", args, timeout=200)


def test_short_run_reports_plans_fanout_and_etcd_load() -> None:
    args = ["--nodes", str(NODES), "--workers", str(WORKERS), "--duration", "10"]
    # the workers' own plan watcher (agents.runtime.plan_watch), one per simulated node
    args += ["--failures", "2", "--failure", "both", "--log-lines", "0.5", "--watch", "plan"]
    result, output = _bench(args)

    assert result["nodes"] == NODES and result["workers"] == WORKERS
    # the workers beat at the heartbeat's rate; their agents wrote one record per node,
    # at most every steady period (agents.node.progress_relay) and on the changes
    assert result["fleet_kept_up"], output
    assert result["progress_beats_per_s"] > 0.5 * result["progress_beats_per_s_intended"]
    assert 0 < result["node_progress_writes_per_s"] <= 1.5 * NODES / 1.0, output
    assert result["etcd_writes_per_s"] < 0.5 * result["progress_beats_per_s"], output
    assert result["etcd_client_bytes_in_per_s"] > 0 and result["etcd_client_bytes_out_per_s"] > 0
    assert result["db_total_mib_end"] > 0
    assert 0 < result["largest_request_bytes"] < 1024 * 1024
    assert result["range_bytes_controller_node_progress"] > 0
    assert 0 < result["controller_cpu_cores"] < 1.5
    assert result["leases_lost"] == 0
    # each failure led to a new plan, which every live node's watcher saw
    failures = result["failures"]
    assert [f["mode"] for f in failures] == ["lease", "crash"]
    for f in failures:
        assert f["failure_to_plan_s"] > 0 and f["plan_to_seen_s"] >= 0, f
        assert f["nodes_seen"] == NODES - 1, f  # all but the failed one
        assert f["node"] in f["reason"], f  # "<spare> replaces <node>"
    crash = failures[1]
    assert 0 <= crash["failure_to_first_report_s"] <= crash["failure_to_last_report_s"], crash
    # the survivors' workers reported through their agents (one record per node) ...
    assert result["range_bytes_controller_node_reports"] > 1000, output
    assert result["range_bytes_controller_reports"] < 100, output  # (an empty range)
    # ... and the controller probed the silent members' agents, the dead one among them
    assert crash["probe_rounds"] and crash["probe_rounds"][0][0] >= 1, crash
    generations = [f["generation"] for f in failures]
    assert generations == sorted(set(generations))
    for name in ("status", "status_all", "events", "logs", "logs_node"):
        assert result[f"{name}_ms_median"] is not None, name
    assert set(result["targets"]) >= {"failure_to_plan_under_2s", "writes_under_2000_per_s"}


def test_static_snapshot_times_the_tick_and_a_crash_report_burst() -> None:
    nodes = 20
    args = ["--static", "--nodes", str(nodes), "--workers", str(WORKERS)]
    result, output = _bench(args)
    assert result["mode"] == "static" and result["tick_read_ms"] > 0, output
    # every member but the crashed one wrote its workers' reports as one record
    assert result["report_burst_puts"] == nodes - 1 and result["report_burst_s"] > 0, output
    assert result["tick_read_ms_in_break"] > 0, output
    assert result["range_bytes_controller_node_reports"] > (nodes - 1) * WORKERS * 50, output
    assert result["range_bytes_controller_reports"] < 100, output
