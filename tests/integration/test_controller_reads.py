"""What keeps the controller's tick cheap at scale: decoded records kept by revision,
liveness probes at once and only of the members left silent, and a loop woken only
by the changes it must act on."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import pytest

from orchestrator.controller.hangs import STALE_BEATS, HangWatch, confirm_after, hung_workers
from orchestrator.controller.job import JobController
from orchestrator.controller.service import wakes
from orchestrator.controller.world import (
    PROBE_SETTLE_S,
    PROBE_THREADS,
    PROGRESS_REUSE_S,
    RecordCache,
    WorldReader,
    probe_all,
)
from orchestrator.etcd.client import EtcdClient
from orchestrator.ports.liveness import Liveness, LivenessServer
from orchestrator.state import keys, records
from orchestrator.state.api import RecordError
from orchestrator.state.records import (
    BreakReport,
    DoneRecord,
    Member,
    NodeBreakReports,
    NodeProgressRecord,
    NodeRecord,
    Plan,
    ProgressRecord,
)
from tests.integration.controller_jobs import register_nodes, submit_two_node_job, two_node_job

pytestmark = pytest.mark.integration


def test_records_are_decoded_again_only_where_their_revision_moved(
    etcd_client: EtcdClient,
) -> None:
    prefix = keys.job_done(f"cache-{uuid.uuid4().hex[:8]}")
    records.write(etcd_client, prefix + "a-0", DoneRecord(1, 1, 1.0))
    records.write(etcd_client, prefix + "b-0", DoneRecord(2, 1, 2.0))
    cache = RecordCache(DoneRecord)
    first = cache.read(etcd_client, prefix)
    records.write(etcd_client, prefix + "b-0", DoneRecord(3, 1, 3.0))
    second = cache.read(etcd_client, prefix)
    assert second["a-0"] is first["a-0"]  # unchanged: the same decoded record
    assert second["b-0"].step == 3
    etcd_client.delete(prefix + "a-0")
    assert sorted(cache.read(etcd_client, prefix)) == ["b-0"]
    # a bad value is still an error naming its key, every time it changes
    etcd_client.put(prefix + "b-0", '{"v": 1, "step": "three"}')
    with pytest.raises(RecordError, match=f"{prefix}b-0: step"):
        cache.read(etcd_client, prefix)


@pytest.fixture
def silent_ports() -> Iterator[list[str]]:
    """Ports that accept a connection and never answer (a frozen agent): a probe times out."""
    socks = []
    for _ in range(6):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        socks.append(s)
    yield [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()


def test_liveness_probes_of_a_tick_run_at_once(silent_ports: list[str]) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    with LivenessServer("127.0.0.1", lambda: {"node": "a"}) as alive:
        addresses = {f"silent-{i}": a for i, a in enumerate(silent_ports)}
        addresses.update({"alive": alive.address, "gone": refused})
        started = time.monotonic()
        verdicts = probe_all(addresses)
        took = time.monotonic() - started
    assert verdicts["alive"] is Liveness.ALIVE
    assert verdicts["gone"] is Liveness.DEAD
    assert {verdicts[f"silent-{i}"] for i in range(6)} == {Liveness.UNKNOWN}
    # six probes that wait out their 0.25 s timeout, one after the other, took 1.5 s
    assert took < 1.0, took


@pytest.mark.parametrize(
    ("kind", "wakes_it"),
    [
        ("nodes/n1", True),
        ("reports/3/n1-0", True),
        ("node-reports/3/n1", True),
        ("commands/0001", True),
        ("done/n1-0", True),
        ("plan", True),
        ("spec", True),
        ("agents/n1/cmd/1", True),
        ("progress/n1-0", False),
        ("node-progress/n1", False),
        ("logs/n1/0/tail", False),
        ("history/123", False),
        ("events/000001", False),
        ("status", False),
    ],
)
def test_the_loop_wakes_at_once_only_for_what_it_acts_on(kind: str, wakes_it: bool) -> None:
    assert wakes(keys.job_prefix("j") + kind) is wakes_it


def test_a_breaks_probes_go_to_the_members_left_silent(etcd_client: EtcdClient) -> None:
    """With more silent members than one round of probes, the reader lets their reports
    land first (PROBE_SETTLE_S), then probes the few left: the dead and the late."""
    job = f"probes-{uuid.uuid4().hex[:8]}"
    n = PROBE_THREADS + 4
    names = [f"n{i:02d}" for i in range(n)]
    asked: dict[str, int] = {name: 0 for name in names}

    def status(name: str) -> dict[str, str]:
        asked[name] += 1
        return {"node": name}

    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    refused = f"127.0.0.1:{gone.getsockname()[1]}"
    gone.close()
    servers = [LivenessServer("127.0.0.1", lambda name=name: status(name)) for name in names[1:]]
    try:
        addresses = {names[0]: refused} | {
            name: srv.address for name, srv in zip(names[1:], servers, strict=True)
        }
        for name, address in addresses.items():
            record = NodeRecord("h", "127.0.0.1", 1, 1, [1], 0.0, liveness=address)
            records.write(etcd_client, keys.job_node(job, name), record)
        plan = Plan(3, [Member(name, i, 1) for i, name in enumerate(names)])
        records.write(etcd_client, keys.job_plan(job), plan)
        reports = keys.job_reports(job, 3)

        def report(name: str) -> None:
            records.write(
                etcd_client,
                reports + keys.worker_id(name, 0),
                BreakReport(5, "peer gone", planned=False, at=time.time()),
            )

        reader = WorldReader(etcd_client, job)
        report(names[-1])  # the first report: every other member is silent
        first = reader.read()
        assert (first.dead, first.alive) == (set(), set())
        assert sum(asked.values()) == 0  # nobody probed while the reports land
        for name in names[2:-1]:  # all but the dead n00 and the late n01 report
            report(name)
        started = time.monotonic()
        world = reader.read()
        # two left silent: probed at once, without waiting out the settle
        assert time.monotonic() - started < PROBE_SETTLE_S
        assert (world.dead, world.alive) == ({names[0]}, {names[1]})
        assert asked == {name: 1 if name == names[1] else 0 for name in names}

        # a rack gone: more silent than a round covers, probed once the settle is over
        reader = WorldReader(etcd_client, job)
        etcd_client.delete_prefix(reports)
        report(names[-1])
        assert reader.read().dead == set()
        time.sleep(PROBE_SETTLE_S)
        world = reader.read()
        assert world.dead == {names[0]} and world.alive == set(names[1:-1])
    finally:
        for srv in servers:
            srv.close()


def test_while_a_break_is_handled_the_progress_read_is_reused_for_a_second(
    etcd_client: EtcdClient,
) -> None:
    """The ticks of a break come as fast as its reports land; the largest range of a
    tick, the workers' progress, is read again only once a second meanwhile."""
    job = f"reuse-{uuid.uuid4().hex[:8]}"

    def beat(step: int) -> None:
        p = ProgressRecord(step, 2, 0, 2, 100, time.time(), time.time())
        record = NodeProgressRecord(time.time(), {keys.worker_id("a", 0): p})
        records.write(etcd_client, keys.node_progress(job, "a"), record)

    def step_seen(reader: WorldReader) -> int:
        return reader.read().progress[keys.worker_id("a", 0)].step

    records.write(etcd_client, keys.job_plan(job), Plan(2, [Member("a", 0, 1), Member("b", 1, 1)]))
    reader = WorldReader(etcd_client, job)
    beat(5)
    assert step_seen(reader) == 5
    beat(6)
    assert step_seen(reader) == 6  # no break: read at every tick
    report = BreakReport(6, "peer gone", planned=False, at=time.time())
    records.write(etcd_client, keys.job_reports(job, 2) + keys.worker_id("a", 0), report)
    assert step_seen(reader) == 6  # the tick that saw the break first
    beat(7)
    assert step_seen(reader) == 6  # reused while the break is handled ...
    time.sleep(PROGRESS_REUSE_S)
    assert step_seen(reader) == 7  # ... for a second at most
    records.write(etcd_client, keys.job_plan(job), Plan(3, [Member("a", 0, 1), Member("c", 1, 1)]))
    beat(8)
    assert step_seen(reader) == 8  # the next generation: read at every tick again


def test_break_reports_are_dropped_two_generations_on(etcd_client: EtcdClient) -> None:
    """A crash at 1,000 x 8 leaves 1.1 MB of reports: a long job's must not pile up.

    A real JobController replaces a node whose registration is gone, twice; the
    reports of a generation go when the one two after it is published."""
    job = f"forget-{uuid.uuid4().hex[:8]}"
    submit_two_node_job(etcd_client, job)

    def register(nodes: list[str]) -> None:
        register_nodes(etcd_client, job, nodes)

    def report(generation: int, node: str) -> None:
        r = BreakReport(5, "peer gone", planned=False, at=time.time())
        records.write(etcd_client, keys.job_reports(job, generation) + keys.worker_id(node, 0), r)
        whole = NodeBreakReports(time.time(), {keys.worker_id(node, 0): r})
        records.write(etcd_client, keys.node_reports(job, generation, node), whole)

    def plan() -> Plan:
        published = records.read(etcd_client, keys.job_plan(job), Plan)
        assert published is not None
        return published

    def kept(generation: int) -> int:
        return len(etcd_client.get_prefix(keys.job_reports(job, generation))) + len(
            etcd_client.get_prefix(keys.job_node_reports(job, generation))
        )

    register(["a", "b", "c", "d"])
    jc = JobController(etcd_client, job)
    try:
        jc.tick()
        assert plan().generation == 1 and [m.node for m in plan().members] == ["a", "b"]
        etcd_client.delete(keys.job_node(job, "b"))  # b's lease expired
        register(["a", "c", "d"])
        jc.tick()
        assert plan().generation == 2
        report(1, "a")  # generation 1's reports (late ones: the policy reads the current's)
        assert kept(1) == 2
        etcd_client.delete(keys.job_node(job, "c"))
        register(["a", "d"])
        jc.tick()
        assert plan().generation == 3
    finally:
        jc.close()  # its watches of the agents
    assert kept(1) == 0  # two generations on: gone
    # the previous generation's stay, for a look and for the reports still on their way
    assert keys.job_node_reports(job, 2) not in keys.stale_report_prefixes(job, 3)


@pytest.mark.parametrize("b_pids", [[100], [101]], ids=["b-frozen", "b-restarted"])
def test_a_beat_stale_only_in_etcd_is_not_a_hang(
    etcd_client: EtcdClient, b_pids: list[int]
) -> None:
    """A worker whose beat is stale in etcd while its agent received fresh ones (the
    agent's writes wait out an etcd leader election) is not killed; one whose agent
    has no fresh beat either is, unless its node's registration no longer lists its
    pid (its agent restarted it: the beat is the exited process's last).  Real
    liveness ports; hung_workers decides."""
    job = f"stale-{uuid.uuid4().hex[:8]}"
    spec = two_node_job(job)
    stale_after = STALE_BEATS * 0.5
    old = time.time() - 2 * stale_after
    received = {"a": time.time(), "b": old}  # what each agent last received from its worker

    def status(node: str) -> dict[str, object]:
        return {"node": node, "beats": {keys.worker_id(node, 0): received[node]}}

    servers = {n: LivenessServer("127.0.0.1", lambda n=n: status(n)) for n in ("a", "b")}
    try:
        for node, srv in servers.items():
            pids = b_pids if node == "b" else [100]
            registration = NodeRecord(node, "127.0.0.1", 1, 1, pids, 0.0, liveness=srv.address)
            records.write(etcd_client, keys.job_node(job, node), registration)
            beat = ProgressRecord(5, 2, 0, 2, 100, old, old)  # stale in etcd for both
            workers = {keys.worker_id(node, 0): beat}
            records.write(
                etcd_client, keys.node_progress(job, node), NodeProgressRecord(old, workers)
            )
        plan = Plan(2, [Member("a", 0, 1), Member("b", 1, 1)])
        records.write(etcd_client, keys.job_plan(job), plan)
        reader = WorldReader(etcd_client, job, quiet_after=stale_after)
        world = reader.read()
        assert world.answering == {"a", "b"}
        assert world.progress[keys.worker_id("a", 0)].beat == received["a"]
        watch = HangWatch()
        assert hung_workers(spec, plan, world, watch) == []  # seen silent once
        first = world.mono
        deadline = time.monotonic() + 30
        while not (world.mono - first >= confirm_after(spec) and world.probed_at["b"] > first):
            assert time.monotonic() < deadline, world  # the agents are probed again
            world = reader.read()
        kills = hung_workers(spec, plan, world, watch)  # and still silent a watch later
        frozen = [keys.worker_id("b", 0)] if 100 in b_pids else []
        assert [k.worker for k in kills] == frozen
    finally:
        for srv in servers.values():
            srv.close()
