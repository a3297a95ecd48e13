"""A real slow link found and swapped for a warm spare, nothing lost.

Real processes and a real slow network: ``node-a`` (agent and workers) runs in a
network namespace joined to the host by one veth pair; ``node-b`` and the spare
``node-c`` run on the host (:mod:`tests.faults.partitioned_job`).  Once the job
trains, both ends of ``node-a``'s veth are limited with ``tc … tbf``: every rank
waits for its bytes, nobody computes longer.  The controller suspects a link,
asks the agents to measure theirs, calls ``node-a`` (all of its links are slow,
``node-b``'s to ``node-c`` is not) and puts the spare in its place: every step is
applied exactly once and the job ends at its full pace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.spec.job import JobSpec, StragglerAction
from orchestrator.state import events, jobs, keys, records
from orchestrator.state.records import Plan
from tests.chaos.jobs import assert_exactly_once, tiny_job
from tests.faults.netns import IsolatedNode, isolated_or_skip
from tests.faults.partitioned_job import partitioned_job, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 250
#: What node-a's link carries once slowed: a few of the tiny model's steps a second.
RATE = "128kbit"


def _job(tmp: Path) -> JobSpec:
    spec = tiny_job("slow-link", tmp, steps=STEPS, step_time=0.03, spares=1)
    ft = spec.fault_tolerance
    ft.heartbeat_interval = timedelta(seconds=1)
    ft.stragglers.action = StragglerAction.SWAP
    ft.stragglers.windows = 2
    ft.stragglers.min_gain = timedelta(0)
    ft.stragglers.confirm = timedelta(seconds=1)
    return spec


@pytest.fixture
def isolated() -> Iterator[IsolatedNode]:
    with isolated_or_skip("slow", "a slow link") as node:
        yield node


def test_a_slow_link_is_measured_called_and_swapped(tmp_path: Path, isolated: IsolatedNode) -> None:
    lines: list[str] = []
    spec = _job(tmp_path)
    job = spec.name
    with partitioned_job(spec, isolated, lines) as running:
        client = running.client
        assert [m.node for m in running.first_plan.members] == ["node-a", "node-b"]
        wait_for(
            "step 60 with a warm spare",
            lambda: (s := jobs.read_status(client, job)) and s.step >= 60 and s.spare_nodes,
        )
        isolated.limit(RATE, burst="16kb", latency="400ms")
        deadline = time.monotonic() + 90
        while not any(e.type == "StragglerSwapped" for e in events.list_events(client, job)):
            assert time.monotonic() < deadline, "\n".join(
                [
                    *lines[-30:],
                    *(f"{e.type}: {e.message}" for e in events.list_events(client, job)),
                    str(jobs.read_status(client, job)),
                ]
            )
            time.sleep(0.2)
        status = wait_for(
            "the end of the job",
            lambda: (s := jobs.read_status(client, job)) and s.phase.terminal and s,
            timeout=150,
        )
        log = events.list_events(client, job)
        plan = records.read(client, keys.job_plan(job), Plan)
    text = "\n".join(lines[-60:])
    assert status.phase is JobPhase.SUCCEEDED and status.step == STEPS, f"{status}\n{text}"
    kinds = [e.type for e in log]
    assert "NodeFailed" not in kinds and "Restart" not in kinds, kinds
    probes = [e for e in log if e.type == "LinkProbe"]
    assert probes and "measuring the links between node-a, node-b, node-c" in probes[0].message
    # node-a may be called for its compute first (it computes 1.2-1.5x here, waiting
    # on its link inside the step): never another node
    assert {e.data["node"] for e in log if e.type == "Straggler"} == {"node-a"}, log
    (called,) = [e for e in log if e.type == "Straggler" and "link is slow" in e.message]
    assert called.data["node"] == "node-a", called
    (swapped,) = [e for e in log if e.type == "StragglerSwapped"]
    assert "node-c replaces node-a (a straggler" in swapped.message, swapped.message
    assert status.quarantined == ["node-a"], status
    assert plan is not None and [m.node for m in plan.members] == ["node-c", "node-b"], plan
    assert_exactly_once(tmp_path, STEPS)
