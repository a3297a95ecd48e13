"""No process a worker started outlives its worker, in either tier (real processes).

Every worker here starts a helper process of its own that ignores SIGTERM and
writes the helper's pid to a file; the tests check by pid that the helpers are
gone after a restart-tier restart, after an in-process hot-swap (a node
SIGKILLed: its whole process tree), after a stop and after the workers'
own end, each checked while ``ringmaster run`` still runs (its own stop at the
end would hide a leak).
"""

from __future__ import annotations

import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.local_run import LocalRun
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs
from tests.chaos.jobs import REPO, quiet_run, summary, tiny_job
from tests.faults.processes import still_running

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]

#: A torchrun script (restart tier): a helper first; in restart 0 rank 1 fails after
#: the first barrier; in restart 1 every rank waits for the job to be stopped.
RESTART_SCRIPT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pathlib import Path

    import torch.distributed as dist

    HELPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    restart, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    helper = subprocess.Popen([sys.executable, "-c", HELPER])
    out = Path(os.environ["RM_HELPER_DIR"])
    (out / f"{restart}-{rank}.tmp").write_text(str(helper.pid))
    (out / f"{restart}-{rank}.tmp").rename(out / f"{restart}-{rank}.pid")
    dist.init_process_group("gloo")
    dist.barrier()
    if restart == "0":
        if dist.get_rank() == 1:
            raise ValueError("boom")
        dist.barrier()  # broken by rank 1's exit, unless this worker is stopped first
    time.sleep(600)  # restart 1: until the job is stopped
    """
)


def _helpers(directory: Path) -> dict[str, int]:
    """``name -> helper pid`` of every helper a worker reported so far."""
    return {p.stem: int(p.read_text()) for p in directory.glob("*.pid")}


def _wait_for_helpers(directory: Path, names: list[str], timeout: float = 120) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _helpers(directory)
        if all(n in found for n in names):
            return found
        time.sleep(0.05)
    raise AssertionError(f"workers {names} did not start within {timeout}s: {_helpers(directory)}")


def _wait_for_agents(run: LocalRun, timeout: float = 60) -> None:
    """Every node agent has left by itself (the run has not stopped them)."""
    for node in run.node_names():
        run.procs[node].popen.wait(timeout)


def test_restart_tier_restart_and_stop_leave_no_helper(tmp_path: Path) -> None:
    script = tmp_path / "helpers.py"
    script.write_text(RESTART_SCRIPT)
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    spec = load_job_data(
        {
            "name": "helpers-restart",
            "entrypoint": {"script": str(script), "env": {"RM_HELPER_DIR": str(helpers)}},
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "checkpoint": {"url": f"file://{tmp_path}/ckpt"},
            "fault_tolerance": {"max_restarts": 1, "recovery": "restart"},
        }
    )
    lines: list[str] = []
    with quiet_run(spec, lines, timeout=timedelta(seconds=150)) as run:
        found = _wait_for_helpers(helpers, ["1-0", "1-1"])
        # restart 1 runs: restart 0's workers (one failed, one stopped by its agent) are gone
        first = [pid for name, pid in found.items() if name.startswith("0-")]
        assert len(first) == 2, found
        assert still_running(first) == [], f"{found}\n" + "\n".join(lines[-40:])
        jobs.request_stop(run.client, spec.name)
        result = run.wait()
        _wait_for_agents(run)
        left = still_running(list(_helpers(helpers).values()))
    assert result.phase is JobPhase.STOPPED, summary(result, lines)
    assert [e.type for e in result.events].count("Restart") == 1, summary(result, lines)
    assert left == [], f"helpers left after the stop: {left}\n{summary(result, lines)}"


def test_in_process_hot_swap_and_the_end_leave_no_helper(tmp_path: Path) -> None:
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    spec = tiny_job(
        "helpers-hot-swap",
        tmp_path,
        steps=80,
        script=REPO / "tests" / "chaos" / "helper_worker.py",
        env={"RM_HELPER_DIR": str(helpers)},
    )
    lines: list[str] = []
    with quiet_run(spec, lines, kill_node_at_step=30) as run:
        result = run.wait()
        assert result.killed_node is not None, summary(result, lines)
        found = _helpers(helpers)
        # the killed node's whole process tree went: its worker's helper too
        killed = [pid for name, pid in found.items() if name.startswith(f"{result.killed_node}-")]
        assert killed and still_running(killed) == [], found
        # the workers ended by themselves, their helpers still running: the agents
        # that saw them exit killed what they left behind, then left
        _wait_for_agents(run)
        left = still_running(list(found.values()))
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries == 1, summary(result, lines)
    assert len(found) == 3, found  # two active nodes and the spare, one worker each
    assert left == [], f"helpers left after the job ended: {left}\n{summary(result, lines)}"
