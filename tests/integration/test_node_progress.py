"""Workers' heartbeats relayed by their node agent: one etcd record per node, at a bounded rate.

Real parts: a real etcd, the agent's :class:`~agents.node.progress_relay.ProgressRelay`
on its local socket, and the workers' own :class:`~agents.runtime.heartbeat.Heartbeat`
(threads here, processes in a job); the controller's view is
:func:`orchestrator.controller.world.read_progress`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from agents.node import progress_relay
from agents.node.progress_relay import MIN_WRITE_GAP_S, NodeProgress, ProgressRelay
from agents.runtime.heartbeat import Heartbeat
from orchestrator.controller.world import read_progress
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.options import EtcdOptions
from orchestrator.state import keys
from orchestrator.state.records import ProgressRecord
from tests.faults.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.integration

NODE = "node-a"


class FakeWorker:
    """What a worker's runtime gives its heartbeat: a step counter and its record."""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank
        self.step = 0
        self.generation = 1

    def progress(self, beat: float, step_time: float) -> ProgressRecord:
        return ProgressRecord(
            step=self.step,
            generation=self.generation,
            rank=self.local_rank,
            world_size=3,
            pid=1000 + self.local_rank,
            beat=beat,
            step_time=step_time,
        )


def _wait(what: str, check: Callable[[], object], timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


@pytest.fixture
def job() -> str:
    return f"relay-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def relay(etcd_client: EtcdClient, job: str) -> Iterator[ProgressRelay]:
    r = ProgressRelay(etcd_client, NodeProgress(job, NODE, heartbeat_interval=2.0))
    yield r
    r.close()


def _heartbeats(
    client: EtcdClient, job: str, relay: ProgressRelay, workers: list[FakeWorker]
) -> list[Heartbeat]:
    beats = [
        Heartbeat(
            client,
            keys.job_progress(job) + keys.worker_id(NODE, w.local_rank),
            lambda w=w: w.step,  # type: ignore[misc]
            w.progress,
            timedelta(seconds=2),
            relay=relay.address,
        )
        for w in workers
    ]
    for hb in beats:
        hb.start()
    return beats


def test_one_record_per_node_at_a_bounded_rate(
    etcd_client: EtcdClient, job: str, relay: ProgressRelay
) -> None:
    workers = [FakeWorker(i) for i in range(3)]
    beats = _heartbeats(etcd_client, job, relay, workers)
    try:
        for hb in beats:
            hb.beat_now()  # synchronous: in etcd when it returns
        seen = read_progress(etcd_client, job)
        assert sorted(seen) == [keys.worker_id(NODE, i) for i in range(3)]
        # nothing under the per-worker keys: the node's record holds them all
        assert not etcd_client.get_prefix(keys.job_progress(job))
        writes_before = relay.progress.writes
        started = time.monotonic()
        while time.monotonic() - started < 3.0:  # a fast loop: a step every 10 ms, poked
            for w, hb in zip(workers, beats, strict=True):
                w.step += 1
                hb.poke()
            time.sleep(0.01)
        elapsed = time.monotonic() - started
        writes = relay.progress.writes - writes_before
        # beats at 5/s per worker would be 3 x 5 x 3 s = 45 puts; steady: one per second
        assert writes <= elapsed / relay.progress.period + 2, writes
        steps = {w: p.step for w, p in read_progress(etcd_client, job).items()}
        assert min(steps.values()) >= workers[0].step - 200, steps  # fresh within a second
    finally:
        for hb in beats:
            hb.stop()


def test_a_change_the_controller_acts_on_is_written_at_once(
    etcd_client: EtcdClient, job: str, relay: ProgressRelay
) -> None:
    workers = [FakeWorker(0), FakeWorker(1)]
    beats = _heartbeats(etcd_client, job, relay, workers)
    try:
        for hb in beats:
            hb.beat_now()
        time.sleep(relay.progress.period)  # a steady write has just happened or is due
        workers[1].generation = 2
        poked = time.monotonic()
        beats[1].poke()
        _wait(
            "generation 2 in etcd",
            lambda: read_progress(etcd_client, job)[keys.worker_id(NODE, 1)].generation == 2,
        )
        took = time.monotonic() - poked
        # the heartbeat's own gap, then the relay's: well under the steady period of 1 s
        assert took < 2 * MIN_WRITE_GAP_S + 0.3, took
    finally:
        for hb in beats:
            hb.stop()


def test_a_frozen_workers_beat_goes_stale_in_its_nodes_record(
    etcd_client: EtcdClient, job: str, relay: ProgressRelay
) -> None:
    workers = [FakeWorker(0), FakeWorker(1)]
    beats = _heartbeats(etcd_client, job, relay, workers)
    try:
        for hb in beats:
            hb.beat_now()
        beats[1].stop()  # its heartbeat thread stops, as in a SIGSTOPped process
        frozen_at = time.time()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            workers[0].step += 1
            beats[0].poke()
            time.sleep(0.05)
        seen = read_progress(etcd_client, job)
        live, frozen = seen[keys.worker_id(NODE, 0)], seen[keys.worker_id(NODE, 1)]
        assert time.time() - live.beat < 1.5, live  # the agent keeps writing the node's record
        assert frozen.beat <= frozen_at, frozen  # but never refreshes a silent worker's beat
    finally:
        for hb in beats:
            hb.stop()


def test_etcd_away_for_the_agent_is_noticed_by_the_workers_own_client() -> None:
    """The worker no longer calls etcd at each beat: its agent's replies make it look."""
    job = f"relay-{uuid.uuid4().hex[:8]}"
    with EtcdCluster(1) as cluster:
        options = EtcdOptions(cluster.endpoints, op_timeout=timedelta(seconds=30))
        agent, worker_client = connect(options), connect(options)
        relay = ProgressRelay(agent, NodeProgress(job, NODE, heartbeat_interval=0.5))
        w = FakeWorker(0)
        (hb,) = _heartbeats(worker_client, job, relay, [w])
        try:
            hb.beat_now()
            time.sleep(0.5)
            assert worker_client.unreachable_for() == 0.0
            cluster.kill(0)
            started = time.monotonic()
            deadline = started + 20
            while worker_client.unreachable_for() < 1.0:
                assert time.monotonic() < deadline, "the worker never saw etcd away"
                w.step += 1  # stepping: every beat is relayed, and the agent cannot write
                hb.poke()
                time.sleep(0.05)
            # the agent's write waited for AWAY_CHECK_S, then the worker's own read hung
            assert time.monotonic() - started < 6.0
            cluster.restart(0)
            cluster.wait_healthy()
            _wait(
                "the worker's client to see etcd back",
                lambda: worker_client.unreachable_for() == 0.0,
                timeout=40,
            )
            _wait(
                "the agent's write after the outage",
                lambda: read_progress(agent, job)[keys.worker_id(NODE, 0)].step >= w.step - 5,
                timeout=20,
            )
        finally:
            hb.stop()
            relay.close()
            agent.close()
            worker_client.close()


def test_close_wakes_the_receiver_rather_than_waiting_for_its_timeout(
    etcd_client: EtcdClient, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no timeout at all on the receive, close() still ends the relay's threads
    (an agent's exit waited up to 0.5 s for each of them)."""
    monkeypatch.setattr(progress_relay, "RECEIVE_TIMEOUT_S", None)
    relay = ProgressRelay(etcd_client, NodeProgress(job, NODE, heartbeat_interval=2.0))
    relay.close()
    assert not any(t.is_alive() for t in relay._threads)
