"""The long-lived path with real processes: one controller serves a job's runs.

A private etcd, one ``ringmaster controller`` that stays up for the whole test
(serving every job, as a long-lived service does) and three ``ringmaster
agent`` processes (two active nodes, one warm spare), each agent in its own
process group with its workers.  The etcd is the test's own: controllers elect
one leader per etcd, so a shared one could hand this job to another test's
controller.  The story:

1. run 1: submit, SIGKILL a whole node (agent and workers) at about step 20,
   the spare takes its slot, then a stop request ends the run ``Stopped`` at
   a step before ``max_steps`` (the stop saves a checkpoint at that step);
2. run 2: resume from the stop checkpoint on the same, still living controller,
   with three agents started again under the same node names; it ends
   ``Succeeded`` at ``max_steps`` with the parameters of an uninterrupted run;
3. both runs' events stay readable, each in its own run;
4. the finished name submitted once more starts run 3, as documented
   (:func:`orchestrator.state.jobs.submit`), and a stop ends it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from checkpoint.catalog import checkpoints
from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.state import events, jobs
from orchestrator.state.records import JobStatus
from orchestrator.state.runs import list_runs
from tests.chaos.jobs import assert_exactly_once, tiny_job
from tests.chaos.test_hot_swap import assert_same_params
from tests.chaos.tiny_by_hand import tiny_final
from tests.faults.processes import Services

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 80
STEP_TIME = 0.04
KILL_AT = 20
NODES = ("node-a", "node-b", "node-c")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """Final parameters of an uninterrupted run of the same job (computed here)."""
    return tiny_final(STEPS)


def _tail(lines: list[str], n: int = 60) -> str:
    return "\n".join(lines[-n:])


def _wait(what: str, check: Callable[[], bool], lines: list[str], timeout: float = 60) -> None:
    """Poll ``check`` until it holds; fail naming ``what``, with the processes' last lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{_tail(lines)}")


def _wait_status(
    client: EtcdClient,
    job: str,
    what: str,
    check: Callable[[JobStatus], bool],
    lines: list[str],
    timeout: float = 60,
) -> JobStatus:
    """Poll the job's status until ``check`` holds for it; return that status."""
    seen: list[JobStatus] = []

    def holds() -> bool:
        seen[:] = [_status(client, job)]
        return check(seen[0])

    try:
        _wait(what, holds, lines, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}\nlast status: {seen[0] if seen else None}") from None
    return seen[0]


def _status(client: EtcdClient, job: str) -> JobStatus:
    status = jobs.read_status(client, job)
    assert status is not None, f"job {job} has no status"
    return status


def _start_agents(services: Services, job: str, endpoint: str, run: int) -> None:
    for node in NODES:
        labels = f"zone=z,rack=r,host={node}"
        args = ["agent", "--job", job, "--node", node, "--labels", labels, "--etcd", endpoint]
        services.start(f"{node}.run{run}", args)


def _exited(services: Services, names: list[str]) -> bool:
    return all(services.procs[n].poll() is not None for n in names)


def test_submit_kill_stop_resume_finish_resubmit(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    lines: list[str] = []
    spec = tiny_job("lifecycle", tmp_path, steps=STEPS, step_time=STEP_TIME, spares=1)
    job = spec.name
    with (
        EmbeddedEtcd() as etcd,
        Services(lines) as services,
        connect(EtcdOptions((etcd.endpoint,))) as client,
    ):
        controller = services.start("controller", ["controller", "--etcd", etcd.endpoint])

        def controller_alive() -> None:
            assert controller.poll() is None, (
                f"the controller exited with {controller.returncode}\n{_tail(lines)}"
            )

        # -- run 1: submit, kill a node, the spare takes over, stop ----------------------
        assert jobs.submit(client, spec) == 1
        _start_agents(services, job, etcd.endpoint, run=1)
        first = _wait_status(
            client,
            job,
            f"run 1 at step {KILL_AT} with a warm spare",
            lambda s: s.step >= KILL_AT and len(s.active_nodes) == 2 and len(s.spare_nodes) == 1,
            lines,
        )
        assert first.phase is JobPhase.RUNNING and first.run == 1, f"{first}\n{_tail(lines)}"
        victim = first.active_nodes[0]
        spare = first.spare_nodes[0]
        killed_at = first.step
        services.signal(f"{victim}.run1", signal.SIGKILL)  # the agent and its workers
        _wait(f"{victim}'s agent to die", lambda: _exited(services, [f"{victim}.run1"]), lines, 10)
        replaced = _wait_status(
            client,
            job,
            f"the spare {spare} to train in {victim}'s place",
            lambda s: (
                s.phase is JobPhase.RUNNING
                and s.generation >= 2
                and spare in s.active_nodes
                and victim not in s.active_nodes
                and s.step >= killed_at + 3
            ),
            lines,
        )
        assert replaced.step < STEPS - 10, f"too late to stop before the end: {replaced}"
        jobs.request_stop(client, job)
        stopped = _wait_status(client, job, "run 1 to end", lambda s: s.phase.terminal, lines)
        text = _tail(lines)
        assert stopped.phase is JobPhase.STOPPED, f"{stopped}\n{text}"
        assert stopped.run == 1 and killed_at < stopped.step < STEPS, f"{stopped}\n{text}"
        survivors = [f"{n}.run1" for n in NODES if n != victim]
        _wait("run 1's agents to leave", lambda: _exited(services, survivors), lines, 30)
        controller_alive()
        (tmp_path / "final.pt").unlink(missing_ok=True)  # run 2 must write its own

        # -- run 2: resume from the stop checkpoint on the same controller, finish -------
        request = jobs.resume(client, job)
        assert killed_at < request.step < STEPS, f"{request} {stopped}\n{_tail(lines)}"
        resumed = _status(client, job)
        assert resumed.run == 2 and resumed.phase is JobPhase.PENDING, resumed
        _start_agents(services, job, etcd.endpoint, run=2)
        finished = _wait_status(
            client, job, "run 2 to end", lambda s: s.run == 2 and s.phase.terminal, lines, 90
        )
        text = _tail(lines)
        assert finished.phase is JobPhase.SUCCEEDED, f"{finished}\n{text}"
        assert finished.run == 2, f"{finished}\n{text}"
        _wait(
            "run 2's agents to leave",
            lambda: _exited(services, [f"{n}.run2" for n in NODES]),
            lines,
            30,
        )
        controller_alive()

        # -- both runs' events, each in its own run ---------------------------------------
        one = events.list_events(client, job, run=1)
        two = events.list_events(client, job, run=2)
        runs = list_runs(client, job)

        # -- a finished name submitted again starts its next run --------------------------
        assert jobs.submit(client, spec) == 3
        third = _status(client, job)
        assert third.run == 3 and third.phase is JobPhase.PENDING, third
        jobs.request_stop(client, job)
        ended = _wait_status(
            client, job, "run 3 to end", lambda s: s.run == 3 and s.phase.terminal, lines
        )
        assert ended.phase is JobPhase.STOPPED and ended.run == 3, f"{ended}\n{_tail(lines)}"
        controller_alive()
        # run 3 added its own events; the first two runs read as before
        assert [e.message for e in events.list_events(client, job, run=1)] == [
            e.message for e in one
        ]
        assert [e.message for e in events.list_events(client, job, run=2)] == [
            e.message for e in two
        ]
        three = events.list_events(client, job, run=3)

    text = _tail(lines)
    log1 = "\n".join(f"{e.type}: {e.message}" for e in one)
    log2 = "\n".join(f"{e.type}: {e.message}" for e in two)
    print(f"killed {victim} at step {killed_at}; {stopped}; resumed from {request}\n{log1}\n{log2}")
    failed = [e for e in one if e.type == "NodeFailed"]
    assert [e.data.get("node") for e in failed] == [victim], f"{log1}\n{text}"
    phases1 = [e.message for e in one if e.type == "Phase"]
    assert any(m.startswith("Stopped:") for m in phases1), log1
    assert not any(m.startswith("Succeeded:") for m in phases1), log1
    phases2 = [e.message for e in two if e.type == "Phase"]
    assert any(m.startswith("Succeeded:") for m in phases2), log2
    assert not any(e.type == "NodeFailed" for e in two), log2
    assert any(e.type == "Phase" and e.message.startswith("Stopped:") for e in three), three
    assert [r.run for r in runs] == [1, 2], runs
    assert runs[0].resume is None and runs[1].resume == request, runs
    # the checkpoints are of the job's lineage: its name and its first run's submission
    saved = [c for c in checkpoints(f"file://{tmp_path}/ckpt") if c.committed]
    lineages = {c.manifest.run_id for c in saved if c.manifest is not None}
    assert saved and len(lineages) == 1, saved
    assert lineages.pop() == f"{job}@{runs[0].submitted_at:.6f}", saved
    # across both runs every step was applied, none twice by one worker
    assert_exactly_once(tmp_path, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), reference)
    ended_at = [ln for ln in lines if ".run2] finished at step" in ln]
    assert len(ended_at) == 1 and f"finished at step {STEPS}:" in ended_at[0], ended_at
    # last, so that everything above is checked even when this fails: run 2's status
    # says it ended at max_steps (the workers' own "finished at step N" lines agree)
    assert finished.step == STEPS, f"run 2 ended at step {finished.step}: {finished}\n{text}"
