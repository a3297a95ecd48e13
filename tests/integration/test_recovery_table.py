"""The join picks its recovery from a table keyed by the kind of state held (real etcd, gloo).

A worker's :class:`~agents.runtime.generation.Generations` joins a generation
(a real plan in etcd, a real fence, plan watcher and checkpointer, a real
one-rank gloo group) and hands the rest of the join to the
:class:`~agents.state.api.Recovery` of the kind of state the session holds.
A fourth kind of state, unknown to ringmaster, needs nothing but its entry in
the table: the generation picks it, and what it restores is what the worker
joins with.  The fourth kind here is a fake (a recovery that records what it
was handed and restores a step of its own): the point is the table, not a
real strategy.
"""

from __future__ import annotations

import multiprocessing as mp
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from agents.api import DurableState, RecoveryError, WorkerEnv
from agents.recovery.kinds import RECOVERIES
from agents.state.api import REPLICAS, SITE_SLICES, SITES, SLICES, Holdings, Joining, Restored
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FOURTH = "fourth"


class FourthRecovery:
    """A fake recovery of a fourth kind of state: it records its join and restores step 7."""

    def __init__(self) -> None:
        self.joined: list[Joining] = []

    def join(self, joining: Joining, holdings: Holdings) -> Restored:
        self.joined.append(joining)
        resumable = joining.durable.can_resume()  # the real checkpointer, opened for it
        return Restored(7, True, None, source=f"fourth (resumable: {resumable})", lost=2)


class FourthHoldings:
    """What a script of the fourth kind holds (nothing the other kinds read)."""

    kind = FOURTH
    sharded = None
    buddies = None
    outer = None

    def replica(self) -> Any:
        return None


def _parts(client: Any, job: str, url: str, recoveries: Mapping[str, Any]) -> tuple[Any, ...]:
    """A worker's real parts for ``job`` on node-0: its generations, its state, its
    checkpoints, its telemetry and its plan watcher (stop it)."""
    import torch

    from agents.runtime.breaks import Breaks
    from agents.runtime.generation import DataPlane, Generations
    from agents.runtime.heartbeat import Heartbeat
    from agents.runtime.plan_watch import PlanWatcher
    from agents.runtime.saving import Saving
    from agents.runtime.telemetry import WorkerTelemetry
    from agents.runtime.worker_state import WorkerState
    from orchestrator.spec.checkpoint import CheckpointSpec
    from orchestrator.spec.job import EntrypointSpec, JobSpec
    from orchestrator.state import keys
    from orchestrator.state.fencing import GenerationFence

    env = WorkerEnv(job=job, node="node-0", local_rank=0, local_world_size=1, etcd_endpoints="")
    spec = JobSpec(
        name=job, entrypoint=EntrypointSpec(script="train.py"), checkpoint=CheckpointSpec(url=url)
    )
    held = WorkerState()
    telemetry = WorkerTelemetry(timed=False)
    fence = GenerationFence(client, job)
    watch = PlanWatcher(client, job)
    heartbeat = Heartbeat(  # not started: it only relays break reports, and none is made
        client,
        keys.job_progress(job) + keys.worker_id(env.node, env.local_rank),
        lambda: held.step,
        lambda beat, at: held.progress(beat, at, metrics={}, telemetry=telemetry.record()),
        timedelta(seconds=1),
        relay="",
    )
    generations = Generations(
        env,
        client,
        fence,
        watch,
        Breaks(env, client, heartbeat),
        telemetry,
        recoveries,
        DataPlane("gloo", torch.device("cpu"), timedelta(seconds=30)),
    )
    durable: DurableState = Saving(env, client, spec, fence, telemetry, held)
    return generations, held, durable, telemetry, watch, spec


def _join(endpoint: str, job: str, url: str, results: Any) -> None:
    """In a fresh process: publish a one-node plan and join it with the fourth kind."""
    from agents.runtime.process_group import teardown_group
    from orchestrator.etcd.client import connect
    from orchestrator.etcd.options import EtcdOptions
    from orchestrator.state import jobs, keys, records
    from orchestrator.state.records import Member, Plan

    client = connect(EtcdOptions((endpoint,)))
    fourth = FourthRecovery()
    generations, held, durable, telemetry, watch, spec = _parts(
        client, job, url, {**RECOVERIES, FOURTH: fourth}
    )
    jobs.submit(client, spec)  # the job whose checkpoints the worker opens
    records.write(client, keys.job_plan(job), Plan(1, [Member("node-0", 0, 1)]))
    try:
        joined = generations.join_next(1, held, FourthHoldings(), durable)
        (joining,) = fourth.joined
        results.put(
            {
                "step": joined.step,
                "has_state": joined.has_state,
                "rank": joined.rank,
                "generation": joined.generation,
                "handed": (joining.rank, joining.world_size, joining.nproc, joining.holds_state),
                "control": joining.control is joined.groups.control,
                "telemetry": (telemetry.restored_from, telemetry.steps_lost),
            }
        )
    finally:
        watch.stop()
        teardown_group()
        client.close()


def test_a_fourth_kind_of_state_in_the_table_is_the_one_the_generation_picks(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    ctx = mp.get_context("spawn")  # a process of its own: the join forms a real gloo group
    results = ctx.Queue()
    job = f"table-{uuid.uuid4().hex[:8]}"
    proc = ctx.Process(target=_join, args=(etcd.endpoint, job, f"file://{tmp_path}", results))
    proc.start()
    try:
        got = results.get(timeout=90)
    finally:
        proc.join(timeout=30)
    assert proc.exitcode == 0, f"the joining process exited with {proc.exitcode}"
    assert (got["step"], got["has_state"]) == (7, True)  # what the fourth kind restored
    assert (got["rank"], got["generation"]) == (0, 1)
    assert got["handed"] == (0, 1, 1, False)  # a fresh worker: no state held yet
    assert got["control"]  # the recovery runs on the generation's own control group
    assert got["telemetry"] == ("fourth (resumable: False)", 2)


def test_a_kind_of_state_missing_from_the_table_is_refused_before_any_join(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job = f"table-{uuid.uuid4().hex[:8]}"
    generations, held, durable, _, watch, _ = _parts(
        etcd_client, job, f"file://{tmp_path}", RECOVERIES
    )
    try:
        with pytest.raises(RecoveryError) as e:
            generations.join_next(1, held, FourthHoldings(), durable)  # no plan: no wait
    finally:
        watch.stop()
    assert "no recovery for state of kind 'fourth'" in str(e.value)
    assert all(kind in str(e.value) for kind in (REPLICAS, SLICES, SITES, SITE_SLICES))


def test_the_table_holds_one_recovery_per_kind_ringmaster_knows() -> None:
    assert set(RECOVERIES) == {REPLICAS, SLICES, SITES, SITE_SLICES}
    assert len({type(r) for r in RECOVERIES.values()}) == 4
