"""A job whose nodes are all gone ends as Failed instead of waiting forever."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from tests.chaos.jobs import REPO, quiet_run

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]


def crashing_job(
    name: str, join_timeout: str, *, nodes: int = 1, script: str | None = None, **env: str
) -> JobSpec:
    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": script or str(REPO / "tests" / "chaos" / "crash_worker.py"),
                "env": env,
            },
            "nodes": {"min": nodes, "max": nodes, "spares": 0},
            "max_steps": 10,
            "fault_tolerance": {"max_restarts": 1},
            "rendezvous": {"join_timeout": join_timeout},
        }
    )


def test_a_script_that_fails_alike_on_every_node_fails_the_job_fast() -> None:
    lines: list[str] = []
    with quiet_run(crashing_job("fails-at-start", "10m", nodes=2), lines) as run:
        result = run.wait()
    assert result.phase is JobPhase.FAILED, "\n".join(lines[-40:])
    failed = [e for e in result.events if e.type == "Phase" and "Failed" in e.message]
    assert failed, result.events
    message = failed[0].message
    assert "failed before their first step" in message and "this script always fails" in message
    assert "join_timeout" not in message
    assert result.wall_s < 60, result.wall_s


# short form: test_a_script_that_fails_alike_on_every_node_fails_the_job_fast (the same
# startup failure of every node: orchestrator/controller/plans.py startup_failure)
@pytest.mark.long
def test_a_missing_script_fails_the_job_within_seconds_naming_the_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "trian.py")
    lines: list[str] = []
    with quiet_run(crashing_job("no-such-file", "10m", nodes=2, script=missing), lines) as run:
        result = run.wait()
    assert result.phase is JobPhase.FAILED, "\n".join(lines[-40:])
    failed = [e for e in result.events if e.type == "Phase" and "Failed" in e.message]
    assert failed and missing in failed[0].message, failed
    assert result.wall_s < 30, result.wall_s


def test_local_run_ends_when_every_agent_has_exited(tmp_path: Path) -> None:
    # each node fails its own way: the controller keeps waiting, the agents give up
    lines: list[str] = []
    spec = crashing_job("agents-gone", "10m", nodes=2, CRASH_PER_NODE="1")
    with quiet_run(spec, lines) as run:
        result = run.wait()
    assert result.phase is JobPhase.FAILED, "\n".join(lines[-40:])
    assert any("every node agent has exited" in line for line in lines), lines[-20:]
    assert result.wall_s < 120
