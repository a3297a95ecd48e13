"""A node's workers follow the plan through their agent's feed, not etcd watches.

A real etcd: the agent's side (:class:`agents.node.watches.NodeWatches` with a
:class:`agents.channels.plan_feed.PlanFeed`) watches the plan and control keys and
passes them on; workers' :class:`agents.runtime.plan_watch.PlanWatcher`\\ s read the
feed, open no watch of their own, and fall back to etcd once the feed ends.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from agents.channels import plan_feed
from agents.channels.plan_feed import CONTROL, PLAN, PlanFeed, frame
from agents.node.watches import NodeWatches
from agents.runtime import plan_watch
from agents.runtime.plan_watch import PlanWatcher
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys, records
from orchestrator.state.records import ControlRecord, Member, Plan

pytestmark = pytest.mark.integration


def plan_of(generation: int) -> Plan:
    return Plan(generation, [Member("a", 0, 1), Member(f"n{generation}", 1, 1)])


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def feed() -> Iterator[PlanFeed]:
    f = PlanFeed()
    yield f
    f.close()


@pytest.fixture
def job() -> str:
    return f"feed-{uuid.uuid4().hex[:8]}"


def watchers(client: EtcdClient, job: str, feed: PlanFeed, count: int) -> list[PlanWatcher]:
    started = [PlanWatcher(client, job, feed.address) for _ in range(count)]
    wait_for(lambda: feed.connected == count, f"{count} workers on the feed")
    return started


def test_every_worker_takes_the_plan_from_the_feed_and_watches_nothing(
    etcd_client: EtcdClient, job: str, feed: PlanFeed
) -> None:
    node = watchers(etcd_client, job, feed, 8)
    assert feed.publish(PLAN, plan_of(2).encode().encode(), 17)
    for w in node:
        plan = w.wait_newer(1, timeout=5)
        assert plan is not None and plan.generation == 2  # not in etcd: it came by the feed
        assert w.revision_of(2) == 17  # what the fence joins with
        assert w.source == "feed" and not w._followers  # no watch of etcd
    control = ControlRecord(checkpoint=3)
    assert feed.publish(CONTROL, control.encode().encode(), 18)
    wait_for(lambda: all(w.control() == control for w in node), "the control record")
    # an older value (a watch event after a re-read) is not passed on or taken
    assert not feed.publish(CONTROL, ControlRecord().encode().encode(), 12)
    assert not feed.publish(PLAN, plan_of(1).encode().encode(), 9)
    time.sleep(0.1)
    assert all(w.control() == control and w.latest_generation() == 2 for w in node)
    for w in node:
        w.stop()


def test_a_worker_that_connects_late_gets_the_newest_at_once(
    etcd_client: EtcdClient, job: str, feed: PlanFeed
) -> None:
    feed.publish(PLAN, plan_of(3).encode().encode(), 30)
    feed.publish(PLAN, plan_of(4).encode().encode(), 40)
    (w,) = watchers(etcd_client, job, feed, 1)
    plan = w.wait_newer(0, timeout=5)
    assert plan is not None and plan.generation == 4 and w.revision_of(4) == 40
    w.stop()


def test_a_worker_watches_etcd_once_the_feed_ends(
    etcd_client: EtcdClient, job: str, feed: PlanFeed
) -> None:
    (w,) = watchers(etcd_client, job, feed, 1)
    feed.close()  # the agent is gone
    wait_for(lambda: w.source == "etcd", "the fall-back to etcd")
    wait_for(
        lambda: len(w._followers) == 2 and all(f.revision is not None for f in w._followers),
        "the watches of plan and control",
    )
    records.write(etcd_client, keys.job_plan(job), plan_of(5))
    plan = w.wait_newer(4, timeout=5)
    assert plan is not None and plan.generation == 5
    w.stop()


def test_a_fed_worker_reads_etcd_now_and_then_in_case_the_agent_is_stuck(
    etcd_client: EtcdClient, job: str, feed: PlanFeed, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_watch, "FEED_REREAD_S", 1.0)
    (w,) = watchers(etcd_client, job, feed, 1)
    records.write(etcd_client, keys.job_plan(job), plan_of(2))  # the agent passes nothing on
    assert w.wait_newer(1, timeout=0.2) is None  # read at start: not again so soon
    time.sleep(1.0)
    plan = w.wait_newer(1, timeout=0.2)  # waited in vain, and the re-read is due
    assert plan is not None and plan.generation == 2 and w.source == "feed"
    w.stop()


def test_a_feed_that_is_not_one_leaves_the_worker_on_etcd(
    etcd_client: EtcdClient, job: str
) -> None:
    (w,) = [PlanWatcher(etcd_client, job, "@ringmaster-no-such-feed")]
    wait_for(lambda: w.source == "etcd", "the fall-back to etcd")
    records.write(etcd_client, keys.job_plan(job), plan_of(2))
    plan = w.wait_newer(1, timeout=5)
    assert plan is not None and plan.generation == 2
    w.stop()


def test_the_agent_passes_on_what_it_watches_with_etcds_revision(
    etcd_client: EtcdClient, job: str, feed: PlanFeed
) -> None:
    first = records.write(etcd_client, keys.job_plan(job), plan_of(1))
    agent = NodeWatches(etcd_client, job, "a", feed)  # an agent's watching half alone
    agent.watch_plan()
    node = watchers(etcd_client, job, feed, 2)
    try:
        for w in node:  # the plan stored before the agent started: from its first read
            wait_for(lambda w=w: w.revision_of(1) == first, "the stored plan")  # type: ignore[misc]
        revision = records.write(etcd_client, keys.job_plan(job), plan_of(2))
        for w in node:
            plan = w.wait_newer(1, timeout=5)
            assert plan is not None and plan.generation == 2 and w.revision_of(2) == revision
        records.write(etcd_client, keys.job_control(job), ControlRecord(stop=True))
        wait_for(lambda: all(w.control().stop for w in node), "the stop request")
        assert all(not w._followers for w in node)
    finally:
        agent.request_stop()
        for w in node:
            w.stop()


def test_a_frame_is_kind_revision_length_then_the_value() -> None:
    assert (
        frame(PLAN, 258, b"xyz")
        == b"p" + (258).to_bytes(8, "big") + (3).to_bytes(4, "big") + b"xyz"
    )


def test_close_wakes_the_accept_rather_than_waiting_for_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no timeout at all on the accept, close() still ends the feed's thread."""
    monkeypatch.setattr(plan_feed, "ACCEPT_TIMEOUT_S", None)
    f = PlanFeed()
    f.close()
    assert not f._thread.is_alive()
