"""Recovery rows for peers that hang instead of dying (used by ``recovery.py``).

* SIGSTOP: one active node's worker is stopped mid-run.  Its heartbeat thread
  stops with it; its agent still answers, so the controller has it killed
  after ``3 x heartbeat_interval`` and its peers' collectives raise at once.
  Target: the next step within ``3 x heartbeat_interval + 2 s``.
* partition: one active node (agent and worker) runs in a network namespace
  whose link is cut (packets dropped both ways).  The survivor's collective
  waits until its operation timeout, learnt from the job's steps
  (``comm.op_timeout_floor`` 1 s here), the cut node is declared failed (its
  lease, ``RINGMASTER_NODE_TTL`` 3 s, or no report within the grace) and the
  spare takes its slot.  Target: the next step within the node lease TTL + 2 s.
  Needs root (network namespaces); the row says so where they cannot be made.

Both measure seconds from the fault to the first step of the new generation
and the steps lost, from the workers' step logs (``examples/train_tiny.py
--step-log``), and read from the ``Recovered`` event what ended the
survivors' failed step.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEP_TIME = 0.02
HEARTBEAT_S = 0.5
NODE_TTL_S = 3.0
FAULT_AT = 100
STEPS = 300

Measure = Callable[[Path, float, bool], tuple[float, int]]


def _job(name: str, logs: Path, steps: int, **extra: Any) -> Any:
    from orchestrator.spec.loader import load_job_data

    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(REPO / "examples" / "train_tiny.py"),
                "args": ["--step-time", str(STEP_TIME), "--step-log", str(logs)],
                "env": {"RINGMASTER_LOG_EVERY": "100000"},
            },
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "max_steps": steps,
            "fault_tolerance": {"heartbeat_interval": f"{HEARTBEAT_S * 1000:g}ms"},
            **extra,
        }
    )


def _ended_by(client: Any, job: str) -> str:
    from orchestrator.state import events

    found = [e for e in events.list_events(client, job) if e.type == "Recovered"]
    return str(found[0].data.get("ended_by", "")) if found else ""


def run_sigstop(
    tmp: Path, measure: Measure, *, steps: int = STEPS, fault_at: int = FAULT_AT
) -> dict[str, Any]:
    """The SIGSTOP row: ``steps`` steps, a worker stopped at ``fault_at``."""
    from orchestrator.controller.world import read_progress
    from orchestrator.local_run import LocalRun
    from orchestrator.state import jobs, keys

    logs = tmp / "steps"
    logs.mkdir()
    spec = _job("bench-sigstop", logs, steps)
    lines: list[str] = []
    with LocalRun(spec, printer=lines.append, workdir=str(REPO)) as run:
        client = run._client
        while True:
            status = jobs.read_status(client, spec.name)
            if status and status.step >= fault_at and status.active_nodes:
                worker = keys.worker_id(status.active_nodes[0], 0)
                p = read_progress(client, spec.name).get(worker)
                if p is not None:
                    stopped_at = time.time()
                    os.kill(p.pid, signal.SIGSTOP)
                    break
            time.sleep(0.01)
        result = run.wait()
        ended_by = _ended_by(client, spec.name)
    assert result.phase.value == "Succeeded", "\n".join(lines[-40:])
    recovery, lost = measure(logs, stopped_at, False)
    return {
        "recovery_s": recovery,
        "steps_lost": lost,
        "ended_by": ended_by,
        "target_s": 3 * HEARTBEAT_S + 2,
    }


def run_partition(
    tmp: Path, measure: Measure, *, steps: int = STEPS, fault_at: int = FAULT_AT
) -> dict[str, Any]:
    """The partition row (``steps`` steps, the node cut off at ``fault_at``), or
    ``{"skipped": why}`` where namespaces cannot be made."""
    from orchestrator.state import jobs, keys, records
    from orchestrator.state.records import Plan
    from tests.faults.netns import IsolatedNode, unavailable_reason
    from tests.faults.partitioned_job import partitioned_job, wait_for

    reason = unavailable_reason()
    if reason is not None:
        return {"skipped": f"needs network namespaces: {reason}"}
    logs = tmp / "steps"
    logs.mkdir()
    spec = _job("bench-partition", logs, steps, comm={"op_timeout_floor": "1s"})
    job = spec.name
    lines: list[str] = []
    with IsolatedNode("bench") as isolated, partitioned_job(spec, isolated, lines) as running:
        client = running.client
        wait_for(
            f"step {fault_at}",
            lambda: (s := jobs.read_status(client, job)) and s.step >= fault_at,
            120,
        )
        isolated.cut()
        cut_at = time.time()
        wait_for(
            "generation 2",
            lambda: (p := records.read(client, keys.job_plan(job), Plan)) and p.generation >= 2,
            60,
        )
        isolated.heal()
        status = wait_for(
            "the end of the job",
            lambda: (s := jobs.read_status(client, job)) and s.phase.terminal and s,
            150,
        )
        ended_by = _ended_by(client, job)
    assert status.phase.value == "Succeeded", "\n".join(lines[-40:])
    recovery, lost = measure(logs, cut_at, False)
    return {
        "recovery_s": recovery,
        "steps_lost": lost,
        "ended_by": ended_by,
        "target_s": NODE_TTL_S + 2,
    }
