"""The table `ringmaster run` ends with: what the tier knows, wrapped, never cut."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from orchestrator.api import JobPhase
from orchestrator.cli.local_commands import NOT_REPORTED, run_table
from orchestrator.local_run import RunResult

pytestmark = pytest.mark.unit


def _render(result: RunResult, width: int = 80) -> str:
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False).print(run_table("aws-cpu-ddp-1", result))
    return out.getvalue()


def _cells(text: str) -> str:
    """The table's words in reading order, whatever their wrapping."""
    rows = [line.split("│") for line in text.splitlines() if "│" in line]
    return " ".join(" ".join(row[i].strip() for row in rows) for i in range(len(rows[0])))


def test_a_restart_tier_run_says_what_its_script_did_not_report() -> None:
    result = RunResult(
        JobPhase.SUCCEEDED,
        step=0,
        recoveries=1,
        wall_s=42.0,
        recovery="restart",
        failed_nodes=["node-0"],
    )
    text = _render(result, width=60)
    assert "…" not in text
    squeezed = "".join(_cells(text).split())  # a narrow column folds words: nothing is lost
    whole = NOT_REPORTED.replace(" ", "")
    assert f"steps{whole}" in squeezed and f"effective{whole}" in squeezed, text
    assert "nodesfailednode-0" in squeezed and "aws-cpu-ddp-1" in squeezed, text


def test_an_in_process_run_shows_its_steps_and_the_node_it_killed() -> None:
    result = RunResult(
        JobPhase.SUCCEEDED,
        step=300,
        recoveries=1,
        wall_s=42.0,
        killed_node="node-0",
        killed_at_step=120,
        effective_fraction=0.93,
        recovery="in_process",
        failed_nodes=["node-0"],
    )
    cells = " ".join(_cells(_render(result)).split())
    assert "steps 300" in cells and "effective 93%" in cells
    assert "node-0 (killed at step 120)" in cells
