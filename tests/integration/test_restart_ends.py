"""The restart tier's ends, with real processes: a finished script finishes, no agent
outlives its job.

* A DDP script that ends in the bad order on purpose
  (``tests/integration/exit_order_worker.py``: one rank returns at once, the
  other with an all-reduce still in flight) under ``ringmaster run``: every
  run succeeds and every agent leaves by itself; before the standby held the
  script's process groups, each of these runs stayed Running for good (the
  worker deadlocked in the gloo group's destructor).  Both orders, twice each.
* A worker whose script returned but whose process does not end (an atexit
  handler that never returns) is killed after the tier's grace, said so in a
  ``WorkerKilled`` event, and counts as done with the script's exit code.
* A node that waits for the generation's store address, which rank 0's agent
  will never publish, stops waiting as soon as its run is over (the job
  failed, or a newer run started): before, it polled etcd every 20 ms for as
  long as it lived.  And with every process real: rank 0 fails before its
  store listens, the job fails, and every agent leaves by itself at once
  instead of being ended by ``ringmaster run``'s SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from agents.node.api import Outcome, TierSetup
from agents.node.restart_tier import RestartTier
from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from orchestrator.state import events, keys, records
from orchestrator.state.records import DoneRecord, JobStatus, Member, Plan
from tests.chaos.jobs import quiet_run, summary

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(150)]

HERE = Path(__file__).resolve().parent


def _job(name: str, tmp: Path, script: Path, args: list[str] | None = None) -> JobSpec:
    """2 nodes and a spare, the restart tier, no restart (a failure is not hidden)."""
    return load_job_data(
        {
            "name": name,
            "entrypoint": {"script": str(script), "args": args or []},
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "checkpoint": {"url": f"file://{tmp}/ckpt"},
            "fault_tolerance": {"recovery": "restart", "max_restarts": 0},
        }
    )


def _agent_lines(lines: list[str], node: str) -> list[str]:
    return [line for line in lines if line.startswith(f"[{node}] ")]


@pytest.mark.parametrize("repeat", [1, pytest.param(2, marks=pytest.mark.long)])
@pytest.mark.parametrize(
    "first",
    [pytest.param(0, marks=pytest.mark.long), 1],  # the one short form: store-host-last
    ids=["store-host-first", "store-host-last"],
)
def test_a_script_that_ends_in_the_bad_order_finishes(
    tmp_path: Path, first: int, repeat: int
) -> None:
    spec = _job(
        f"order-{first}-{repeat}", tmp_path, HERE / "exit_order_worker.py", ["--first", str(first)]
    )
    lines: list[str] = []
    with quiet_run(spec, lines, timeout=timedelta(seconds=60)) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    # the teardown did not hang: nothing had to be killed after its script returned
    assert not [e for e in result.events if e.type == "WorkerKilled"], summary(result, lines)
    generation = next(e for e in result.events if e.type == "Generation").message
    for node in ("node-0", "node-1", "node-2"):
        if node in generation:  # the active nodes
            own = "\n".join(_agent_lines(lines, node))
            assert "leaving: job Succeeded" in own, own


class _Plans:
    """A plan source for a tier built alone."""

    def __init__(self) -> None:
        self.latest_plan: Plan | None = None


def _tier(
    client: EtcdClient, tmp: Path, job: str, node: str, script: Path, nodes: int
) -> tuple[RestartTier, _Plans, threading.Event]:
    """A restart tier built alone (no agent, no controller), with its warm standby."""
    spec = load_job_data(
        {
            "name": job,
            "entrypoint": {"script": str(script)},
            "nodes": {"min": nodes, "max": nodes},
            "fault_tolerance": {"recovery": "restart"},
        }
    )
    stop = threading.Event()
    setup = TierSetup(
        client=client,
        job=job,
        node=node,
        run=1,
        spec=spec,
        workdir=str(tmp),
        errors_dir=tmp,
        stop=stop,
        worker_env=lambda _: {**os.environ, "OMP_NUM_THREADS": "1"},
        register=lambda: None,
    )
    plans = _Plans()
    tier = RestartTier(setup, "127.0.0.1", plans, returned_grace=1.0)
    tier.start()
    return tier, plans, stop


def test_a_worker_that_outlives_its_script_is_killed_and_counts_as_done(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job = f"stuck-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "stuck.py"
    script.write_text(
        "import atexit, threading\n"
        "atexit.register(threading.Event().wait)  # never returns\n"
        "print('trained', flush=True)\n"
    )
    tier, plans, stop = _tier(etcd_client, tmp_path, job, "n0", script, nodes=1)
    plans.latest_plan = Plan(1, [Member("n0", 0, 1)])
    outcome: list[Outcome] = []
    supervisor = threading.Thread(target=lambda: outcome.append(tier.supervise()))
    supervisor.start()
    done_key = keys.job_done(job) + keys.worker_id("n0", 0)
    try:
        deadline = time.monotonic() + 60
        while etcd_client.get(done_key) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = tier.workers.get(0)
    finally:
        stop.set()
        supervisor.join(10)
        tier.close()
    done = records.read(etcd_client, done_key, DoneRecord)
    assert done is not None and done.generation == 1, "the worker was never recorded done"
    assert worker is not None and not worker.running()
    killed = [e for e in events.list_events(etcd_client, job) if e.type == "WorkerKilled"]
    assert len(killed) == 1, killed
    assert "its script returned (exit code 0)" in killed[0].message, killed[0].message
    assert "its process group was killed" in killed[0].message


@pytest.mark.parametrize("end", ["failed", "next-run"])
def test_waiting_for_the_store_address_ends_with_the_run(
    etcd_client: EtcdClient, tmp_path: Path, end: str
) -> None:
    job = f"no-store-{uuid.uuid4().hex[:8]}"
    records.write(etcd_client, keys.job_status(job), JobStatus(job, JobPhase.RUNNING, run=1))
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('never launched: no store address comes')\n")
    tier, plans, stop = _tier(etcd_client, tmp_path, job, "n1", script, nodes=2)
    # rank 0 is on n0, whose agent never publishes the store's address
    plans.latest_plan = Plan(1, [Member("n0", 0, 1), Member("n1", 1, 1)])
    outcome: list[Outcome] = []
    supervisor = threading.Thread(target=lambda: outcome.append(tier.supervise()))
    supervisor.start()
    try:
        deadline = time.monotonic() + 30
        while tier.generation != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tier.generation == 1 and not tier.workers, "generation 1 was not taken up"
        if end == "failed":
            ended = JobStatus(job, JobPhase.FAILED, run=1)
        else:  # stopped, then resubmitted: the status is the next run's
            ended = JobStatus(job, JobPhase.PENDING, run=2)
        records.write(etcd_client, keys.job_status(job), ended)
        supervisor.join(5)
        assert not supervisor.is_alive(), "still waiting for the store 5s after the run ended"
    finally:
        stop.set()
        supervisor.join(10)
        tier.close()
    expected = {
        "failed": Outcome("job Failed", exit_code=1),
        "next-run": Outcome("run 1 of the job is over (run 2 started)"),
    }[end]
    assert outcome == [expected]
    assert not tier.workers


def test_agents_leave_when_rank_0_fails_before_its_store_listens(tmp_path: Path) -> None:
    script = tmp_path / "early.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['RANK'] == '0':\n"
        "    sys.exit('rank 0 gives up before init_process_group')\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
    )
    spec = _job("early-end", tmp_path, script)
    lines: list[str] = []
    with quiet_run(spec, lines, timeout=timedelta(seconds=60)) as run:
        result = run.wait()
        ended = time.monotonic()
        agents = {n: p.popen for n, p in run.procs.items() if n.startswith("node-")}
        while any(p.poll() is None for p in agents.values()) and time.monotonic() < ended + 10:
            time.sleep(0.05)
        still = sorted(n for n, p in agents.items() if p.poll() is None)
    assert result.phase is JobPhase.FAILED, summary(result, lines)
    assert not still, f"agents still running 10s after the job failed: {still}\n" + "\n".join(
        lines[-40:]
    )
    text = "\n".join(lines)
    assert "preempted (SIGTERM)" not in text, text[-3000:]
    for node in agents:
        own = "\n".join(_agent_lines(lines, node))
        assert "leaving: job Failed" in own, own


def test_a_preempted_nodes_script_gets_preemption_grace_to_save(tmp_path: Path) -> None:
    """SIGTERM to a node's agent (a preemption): its workers get SIGTERM and up to
    ``fault_tolerance.preemption_grace`` to exit, as torchrun gives them; a script that
    saves on SIGTERM for longer than the agent's own stop sequence (5 s) still saves."""
    spec = load_job_data(
        {
            "name": "preempt-restart",
            "entrypoint": {
                "script": str(HERE / "sigterm_saver.py"),
                "args": [str(tmp_path), "5.5"],
            },
            "nodes": {"min": 1, "max": 1, "spares": 0},
            "checkpoint": {"url": f"file://{tmp_path}/ckpt"},
            "rendezvous": {"join_timeout": "1s"},
            "fault_tolerance": {
                "recovery": "restart",
                "max_restarts": 0,
                "preemption_grace": "9s",
            },
        }
    )
    lines: list[str] = []
    with quiet_run(spec, lines, timeout=timedelta(seconds=60)) as run:
        deadline = time.monotonic() + 45
        while not (tmp_path / "started-0").exists():
            assert time.monotonic() < deadline, "\n".join(lines[-40:])
            time.sleep(0.05)
        run.procs["node-0"].popen.send_signal(signal.SIGTERM)
        run.wait()
    assert (tmp_path / "saved-0").read_text() == "5.5\n", "\n".join(lines[-40:])
    said = "\n".join(_agent_lines(lines, "node-0"))
    assert "the workers get SIGTERM and 9s to exit (fault_tolerance.preemption_grace)" in said
