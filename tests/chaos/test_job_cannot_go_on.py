"""A job whose nodes are all gone ends as Failed instead of waiting forever."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.spec import JobSpec
from orchestrator.spec_loader import load_job_data
from tests.chaos.jobs import REPO, quiet_run

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]


def crashing_job(name: str, join_timeout: str) -> JobSpec:
    return load_job_data(
        {
            "name": name,
            "entrypoint": str(REPO / "tests" / "chaos" / "crash_worker.py"),
            "nodes": {"min": 1, "max": 1, "spares": 0},
            "max_steps": 10,
            "fault_tolerance": {"max_restarts": 1},
            "rendezvous": {"join_timeout": join_timeout},
        }
    )


def test_controller_fails_a_job_whose_nodes_never_come_up(tmp_path: Path) -> None:
    lines: list[str] = []
    with quiet_run(crashing_job("no-nodes-left", "2s"), lines) as run:
        result = run.wait()
    assert result.phase is JobPhase.FAILED, "\n".join(lines[-40:])
    failed = [e for e in result.events if e.type == "Phase" and "Failed" in e.message]
    assert failed and "rendezvous.join_timeout" in failed[0].message, failed
    exits = [e for e in result.events if e.type == "WorkerExited"]
    assert len(exits) == 2  # the first start and its one restart
    assert "this script always fails" in exits[0].message


def test_local_run_ends_when_every_agent_has_exited(tmp_path: Path) -> None:
    lines: list[str] = []
    with quiet_run(crashing_job("agents-gone", "10m"), lines) as run:
        result = run.wait()
    assert result.phase is JobPhase.FAILED, "\n".join(lines[-40:])
    assert any("every node agent has exited" in line for line in lines), lines[-20:]
    assert result.wall_s < 120
