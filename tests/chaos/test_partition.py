"""A node cut off by a network partition is replaced, then fenced when it returns.

One active node runs (agent and workers) in its own network namespace
(:mod:`tests.faults.netns`), reaching etcd and its peers only through a veth
link; the other active node and the spare run on the host.  Cutting the link
drops every packet both ways: the survivor's stuck collective times out
(the operation timeout learnt from the job's steps, here its 1 s floor), it
reports, the cut node's lease expires or its report does not come within the
grace, the controller puts the spare in its slot, and the survivor joins the
new generation.  When the link comes back the old node learns from
etcd that a newer generation left it out: it drops its stale state, writes
nothing for the current generation and commits no checkpoint (every write
and commit is fenced by the plan revision it joined).  The job ends with the
parameters of a fault-free run and no step applied twice.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkpoint.commit import committed_checkpoints
from checkpoint.fsspec_storage import Location
from orchestrator.api import JobPhase
from orchestrator.controller.world import read_progress
from orchestrator.etcd.client import EtcdClient
from orchestrator.spec.job import JobSpec
from orchestrator.state import events, jobs, keys, records
from orchestrator.state.records import CheckpointRecord, Plan
from tests.chaos.jobs import assert_exactly_once, step_log, tiny_job
from tests.chaos.tiny_by_hand import tiny_final
from tests.faults.netns import IsolatedNode, isolated_or_skip
from tests.faults.partitioned_job import partitioned_job, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 100
#: Collectives never wait longer than twice this.
HANG_TIMEOUT = "4s"
#: How long the survivor's collective waits on the cut peer: 10 x the slowest
#: recent step (about 0.1 s here) is under this floor, so the floor applies.
OP_TIMEOUT_FLOOR = "1s"
#: The workers wait before this step until the test lets them go: the spare's
#: workers import torch meanwhile (on a loaded machine the job could end first).
HOLD_AT = 25


def go_file(tmp: Path) -> Path:
    """The file whose existence lets the workers past :data:`HOLD_AT`."""
    return tmp / "go"


def partition_job(name: str, tmp: Path, spares: int) -> JobSpec:
    spec = tiny_job(
        name,
        tmp,
        steps=STEPS,
        step_time=0.05,
        spares=spares,
        hang_timeout=HANG_TIMEOUT,
        comm={"op_timeout_floor": OP_TIMEOUT_FLOOR},
        extra_args=["--hold-at", str(HOLD_AT), "--go-file", str(go_file(tmp))],
    )
    # periodic asynchronous checkpoints, so commits happen around the partition
    return dataclasses.replace(
        spec, checkpoint=dataclasses.replace(spec.checkpoint, every_steps=10)
    )


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """Final parameters of a fault-free run of the same job (computed here)."""
    return tiny_final(STEPS)


@pytest.fixture
def isolated() -> Iterator[IsolatedNode]:
    with isolated_or_skip("part", "the partition test") as node:
        yield node


def _plan(client: EtcdClient, job: str) -> Plan | None:
    return records.read(client, keys.job_plan(job), Plan)


def test_partitioned_node_is_replaced_and_fenced(
    tmp_path: Path, isolated: IsolatedNode, reference: dict[str, torch.Tensor]
) -> None:
    lines: list[str] = []
    spec = partition_job("partition", tmp_path, spares=1)
    job = spec.name
    with partitioned_job(spec, isolated, lines) as running:
        client = running.client
        first = running.first_plan
        assert [m.node for m in first.members] == ["node-a", "node-b"], first
        wait_for(
            "step 20 with a warm spare",
            lambda: (
                (s := jobs.read_status(client, job)) and s.step >= 20 and "node-c" in s.spare_nodes
            ),
        )
        go_file(tmp_path).touch()  # training goes on, and is cut off mid-run
        isolated.cut()
        cut_at = time.time()
        second = wait_for(
            "generation 2", lambda: (p := _plan(client, job)) and p.generation >= 2 and p
        )
        first_step_gen2 = wait_for(
            "training in generation 2",
            lambda: (
                (p := read_progress(client, job).get("node-c-0"))
                and p.generation == 2
                and p.step > 0
                and p.step
            ),
        )
        isolated.heal()
        status = wait_for(
            "the end of the job",
            lambda: (s := jobs.read_status(client, job)) and s.phase.terminal and s,
            timeout=150,
        )
        # the fenced node reads the new plan after the link is back, then leaves
        wait_for(
            "node-a to learn it was fenced",
            lambda: any("[node-a]" in line and "fenced out" in line for line in lines),
            timeout=30,
        )
        log = events.list_events(client, job)
        record = records.read(client, keys.job_checkpoint(job), CheckpointRecord)
    text = "\n".join(lines[-80:])
    assert status.phase is JobPhase.SUCCEEDED, f"{status}\n{text}"
    assert [m.node for m in second.members] == ["node-c", "node-b"], f"{second}\n{text}"
    failed = [e for e in log if e.type == "NodeFailed"]
    assert [e.data.get("node") for e in failed] == ["node-a"], f"{failed}\n{text}"
    # declared when its lease expired, or sooner: the survivor's collective timed out
    # (1 s), it reported, and node-a, unreachable, sent no report within the grace
    assert failed[0].data.get("cause") in ("lease_expiry", "unresponsive"), failed[0]
    assert_exactly_once(tmp_path, STEPS)
    # node-a applied no step of generation 2, before or after the link came back
    for worker, seq in step_log(tmp_path).items():
        if worker.startswith("node-a"):
            assert max(seq) < first_step_gen2, f"{worker} {seq}\n{text}"
    gen_of_step = _generations(tmp_path)
    assert all(g == {1} for w, g in gen_of_step.items() if w.startswith("node-a")), gen_of_step
    # checkpoints: unique steps, each committed by a two-rank generation; the
    # record names one of them and was written after the cut by the new generation
    root = Location.from_url(spec.checkpoint.url)
    committed = committed_checkpoints(root)
    steps = [c.step for c in committed]
    assert len(steps) == len(set(steps)), steps
    assert all(c.manifest is not None and c.manifest.world_size == 2 for c in committed)
    assert record is not None and record.step in steps, f"{record} {steps}\n{text}"
    assert record.at > cut_at, f"{record} written before the cut at {cut_at}"
    # the survivor's collective waited on the cut peer until its operation timeout
    (recovered,) = [e for e in log if e.type == "Recovered"]
    assert recovered.data.get("ended_by") == "timeout", f"{recovered}\n{text}"


def _generations(tmp: Path) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for f in sorted((tmp / "steps").glob("*.log")):
        out[f.stem] = {int(line.split()[1]) for line in f.read_text().splitlines()}
    return out
