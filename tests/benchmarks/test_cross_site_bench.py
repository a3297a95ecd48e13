"""The cross-site benchmark in its short form: one Streaming DiLoCo job across the slow link.

``benchmarks/cross_site.py`` builds two sites in network namespaces joined by a
``tbf``-limited link and runs whole ringmaster jobs across it.  Here it runs one
row with a tiny model, two ranks per site as its default, and its JSON line is
checked for what the benchmark exists to report: a step rate, the bytes that
crossed the link (from tc's counters: more than zero, so the sites' traffic
really went over the limited link), the loss, the curve of the loss along the
way, and each rank's outer steps per fragment.
Needs root for the namespaces; skipped otherwise, as the benchmark itself skips.
"""

from __future__ import annotations

import pytest

from tests.benchmarks.runner import run_benchmark
from tests.faults.netns import unavailable_reason

# a benchmark's short run with its figures checked: `make bench-smoke` (CI runs it beside make test)
pytestmark = [pytest.mark.bench_smoke, pytest.mark.timeout(240)]


def test_a_streaming_diloco_row_crosses_the_limited_link() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"two sites need network namespaces: {reason}")
    args = [
        "--rates",
        "100mbit",
        "--only",
        "streaming_100mbit",
        "--seeds",
        "0",
        "--corpus",
        "argparse",
        "--eval-every",
        "10",
        "--steps",
        "30",
        "--width",
        "32",
        "--layers",
        "1",
        "--inner-steps",
        "10",
        "--fragments",
        "2",
        "--delay-steps",
        "1",
    ]
    result, _ = run_benchmark("cross_site", args, timeout=220)
    assert result["steps"] == 30 and result["streaming_fragments"] == 2, result
    assert result["streaming_100mbit_steps_per_s"] > 0, result
    # tiny as the model is, its 4-bit fragments and the step boundary's votes crossed
    assert result["streaming_100mbit_link_kb_per_step"] > 0.5, result
    assert 0 < result["streaming_100mbit_eval_loss"] < 6, result
    # each site's first rank (the ranks that evaluate) applied every outer step of each
    # fragment (30 steps, H 10)
    assert result["streaming_100mbit_outer_steps_by_rank"] == [[3, 3]] * 2, result
