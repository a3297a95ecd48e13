"""The recovery-at-size benchmark in its short form: one heal of 20 MB of state.

``benchmarks/recovery_at_size.py`` runs a real job (etcd, controller, three
agents, gloo workers of ``examples/train_wide.py``), SIGKILLs an active node,
and measures the wire's limit for the same bytes; here it runs at its
smallest size with ``--checksum``, and its JSON line is checked for what the
benchmark exists to report: the phases of the recovery, the bytes moved, the
heal's throughput against both limits, the peak memory of the sender and the
receiver, and a receiver whose healed state equals the survivor's.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.benchmarks.runner import run_benchmark

# a benchmark's short run with its figures checked: `make bench-smoke` (CI runs it beside make test)
pytestmark = [pytest.mark.bench_smoke, pytest.mark.timeout(300)]

SIZE_GB = 0.02


def _bench(args: list[str]) -> tuple[dict[str, Any], str]:
    return run_benchmark("recovery_at_size", args, timeout=270)


def test_a_heal_of_20_mb_is_measured_against_the_wire_and_equals_the_survivors_state() -> None:
    result, output = _bench(["--sizes", str(SIZE_GB), "--checksum", "--limit-rounds", "1"])

    assert result["sizes_gb"] == [SIZE_GB] and result["checksum"] is True
    assert {"_s", "_bytes", "_mb_per_s", "state_gb"} <= set(result["units"]), result["units"]
    assert result["targets"], result
    [row] = result["rows"]
    assert "skipped" not in row, row
    # 16 bytes per parameter (parameter, two Adam moments, EMA) and Adam's step counts
    assert row["state_bytes"] == 16 * row["parameters"] + 4 * 2 * row["layers"], row
    assert abs(row["state_bytes"] - SIZE_GB * 1e9) < 0.01 * SIZE_GB * 1e9, row
    assert row["receiver_state_bytes"] == row["state_bytes"] == row["bytes_moved"], row
    # the receiver took over the killed rank's place with the survivor's state
    assert row["structure_equal"] is True and row["data_equal"] is True, output
    assert row["restored_step"] == row["step"] >= 3, row
    # the phases add up to the time from the kill to the next step
    phases = ("detect_s", "rendezvous_s", "restore_s", "first_step_s")
    assert all(row[p] >= 0 for p in phases), row
    assert math.isclose(sum(row[p] for p in phases), row["next_step_s"], abs_tol=2e-3), row
    assert 0 < row["next_step_s"] < 30, row
    assert row["restore_s"] > 0, row
    assert math.isclose(
        row["heal_mb_per_s"], row["bytes_moved"] / row["restore_s"] / 1e6, rel_tol=1e-2
    ), row
    for transport in ("gloo", "socket"):
        limit = row[f"{transport}_limit_mb_per_s"]
        assert limit > 0 and row[f"{transport}_limit_s"] > 0, row
        assert math.isclose(
            row[f"heal_ratio_to_{transport}"], row["heal_mb_per_s"] / limit, rel_tol=1e-2
        ), row
    # peak memory around the heal: each holds the state at least, beside its baseline
    for side in ("sender", "receiver"):
        peak, baseline = row[f"{side}_peak_rss_bytes"], row[f"{side}_rss_baseline_bytes"]
        assert peak is not None and baseline is not None, row
        assert peak - baseline >= row["state_bytes"] * 0.9, row
        assert row[f"{side}_peak_over_state"] > row[f"{side}_peak_less_baseline_over_state"], row
