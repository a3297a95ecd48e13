"""Break reports relayed by the node agent: one etcd record per node instead of one per worker.

Real parts: a real etcd, the agent's :class:`~agents.node.progress_relay.ProgressRelay`
with its :class:`~agents.node.break_reports.NodeReports` on a local socket, and the
workers' own :class:`~agents.runtime.heartbeat.Heartbeat` (threads here, processes in
a job); the controller's view is :func:`orchestrator.controller.world.read_reports`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from agents.node.break_reports import GATHER_S, NodeReports
from agents.node.progress_relay import NodeProgress, ProgressRelay
from agents.runtime.heartbeat import Heartbeat
from orchestrator.controller.world import read_reports
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys, records
from orchestrator.state.records import BreakReport, NodeBreakReports, ProgressRecord

pytestmark = pytest.mark.integration

NODE = "node-a"
SLOTS = 3


def _progress(beat: float, step_time: float) -> ProgressRecord:
    return ProgressRecord(0, 1, 0, SLOTS, 1000, beat, step_time)


def _report(step: int, reason: str = "peer gone") -> BreakReport:
    return BreakReport(step=step, reason=reason, planned=False, at=time.time())


@pytest.fixture
def job() -> str:
    return f"reports-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def relay(etcd_client: EtcdClient, job: str) -> Iterator[ProgressRelay]:
    r = ProgressRelay(
        etcd_client,
        NodeProgress(job, NODE, heartbeat_interval=2.0),
        NodeReports(job, NODE, SLOTS),
    )
    yield r
    r.close()


@pytest.fixture
def heartbeats() -> Iterator[list[Heartbeat]]:
    made: list[Heartbeat] = []
    yield made
    for hb in made:
        hb.stop()  # closes its socket to the agent


@pytest.fixture
def heartbeat(
    etcd_client: EtcdClient, job: str, heartbeats: list[Heartbeat]
) -> Callable[[str, int], Heartbeat]:
    """A worker's heartbeat (not started: its link to the agent is what is used)."""

    def make(address: str, local_rank: int) -> Heartbeat:
        key = keys.job_progress(job) + keys.worker_id(NODE, local_rank)
        hb = Heartbeat(etcd_client, key, lambda: 0, _progress, timedelta(seconds=2), relay=address)
        heartbeats.append(hb)
        return hb

    return make


def test_a_nodes_workers_reports_are_one_write(
    etcd_client: EtcdClient, job: str, relay: ProgressRelay, heartbeat: Callable[..., Heartbeat]
) -> None:
    beats = [heartbeat(relay.address, i) for i in range(SLOTS)]
    taken: dict[int, bool] = {}

    def report(i: int) -> None:
        taken[i] = beats[i].relay_report(4, _report(17 + i))

    threads = [threading.Thread(target=report, args=(i,)) for i in range(SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert taken == {0: True, 1: True, 2: True}  # each answered once it was in etcd
    assert relay.reports is not None
    assert relay.reports.writes == 1  # all reported within the gather: one put for the node
    # nothing under the per-worker keys: the node's record holds them all
    assert not etcd_client.get_prefix(keys.job_reports(job, 4))
    seen = read_reports(etcd_client, job, 4)
    assert {w: r.step for w, r in seen.items()} == {
        keys.worker_id(NODE, i): 17 + i for i in range(SLOTS)
    }
    assert read_reports(etcd_client, job, 3) == {}  # keyed by generation


def test_a_late_worker_is_added_by_another_write(
    etcd_client: EtcdClient, job: str, relay: ProgressRelay, heartbeat: Callable[..., Heartbeat]
) -> None:
    first = heartbeat(relay.address, 0)
    started = time.monotonic()
    assert first.relay_report(2, _report(5))
    # one of three reported: the agent waited out the gather for the others, then wrote
    assert time.monotonic() - started >= GATHER_S
    assert list(read_reports(etcd_client, job, 2)) == [keys.worker_id(NODE, 0)]
    late = heartbeat(relay.address, 2)
    assert late.relay_report(2, _report(5, "late"))
    seen = read_reports(etcd_client, job, 2)
    assert sorted(seen) == [keys.worker_id(NODE, 0), keys.worker_id(NODE, 2)]
    assert seen[keys.worker_id(NODE, 2)].reason == "late"
    assert relay.reports is not None and relay.reports.writes == 2


def test_a_worker_whose_agent_is_gone_is_told_to_write_its_own(
    etcd_client: EtcdClient, job: str, heartbeat: Callable[..., Heartbeat]
) -> None:
    # an agent that relays progress but keeps no reports says so at once
    relay = ProgressRelay(etcd_client, NodeProgress(job, NODE, heartbeat_interval=2.0))
    started = time.monotonic()
    assert heartbeat(relay.address, 2).relay_report(1, _report(3)) is False
    assert time.monotonic() - started < 0.5  # answered, not waited out
    address = relay.address
    relay.close()  # the agent died: its socket is gone
    hb = heartbeat(address, 0)
    started = time.monotonic()
    assert hb.relay_report(1, _report(3)) is False
    assert time.monotonic() - started < 0.5  # refused at once, not waited out
    assert read_reports(etcd_client, job, 1) == {}  # nothing was written for them
    no_relay = heartbeat("", 1)  # a worker started without an agent
    assert no_relay.relay_report(1, _report(3)) is False


def test_the_controller_merges_both_kinds_and_a_workers_own_wins(
    etcd_client: EtcdClient, job: str
) -> None:
    """A worker that wrote its own report (its agent did not answer in time) is read as
    itself, also when the agent's record for its node names it too."""
    w0, w1 = keys.worker_id(NODE, 0), keys.worker_id(NODE, 1)
    own = _report(9, "written by the worker")
    records.write(etcd_client, keys.job_reports(job, 6) + w1, own)
    node = NodeBreakReports(time.time(), {w0: _report(9), w1: _report(9, "relayed")})
    records.write(etcd_client, keys.node_reports(job, 6, NODE), node)
    records.write(
        etcd_client,
        keys.node_reports(job, 6, "node-b"),
        NodeBreakReports(time.time(), {keys.worker_id("node-b", 0): _report(9)}),
    )
    seen = read_reports(etcd_client, job, 6)
    assert sorted(seen) == sorted([w0, w1, keys.worker_id("node-b", 0)])
    assert seen[w1].reason == "written by the worker"
