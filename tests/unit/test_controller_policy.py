"""The controller's policy, driven through a table of scenarios without etcd.

Each scenario builds a snapshot of the world (nodes, heartbeats, plan,
reports), runs :func:`orchestrator.controller.policy.decide` one or more
times, and checks the actions and the status it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import pytest

from orchestrator.api import JobPhase
from orchestrator.controller import hangs, policy
from orchestrator.controller.actions import (
    Action,
    DeclareFailed,
    DeleteCommand,
    Emit,
    KillWorker,
    PhaseChanged,
    PublishPlan,
    Recovered,
    WriteControl,
)
from orchestrator.controller.world import World
from orchestrator.spec.job import EntrypointSpec, JobSpec, NodesSpec, RecoveryMode, SyncMode
from orchestrator.state import keys
from orchestrator.state.records import (
    BreakReport,
    CommandRecord,
    DoneRecord,
    JobStatus,
    Member,
    NodeRecord,
    Plan,
    ProgressRecord,
    Telemetry,
)
from orchestrator.topology import min_ring_crossings, ring_crossings

pytestmark = pytest.mark.unit

NOW = 1_000_000.0
RACKS = {"a": "r1", "b": "r2", "c": "r1", "d": "r2", "e": "r2", "f": "r1"}


def _spec(min_nodes: int = 2, max_nodes: int = 2, spares: int = 1, **ft: object) -> JobSpec:
    spec = JobSpec(
        name="job",
        entrypoint=EntrypointSpec(script="train.py"),
        nodes=NodesSpec(min=min_nodes, max=max_nodes, spares=spares),
    )
    for key, value in ft.items():
        setattr(spec.fault_tolerance, key, value)
    spec.rendezvous.join_timeout = timedelta(seconds=30)
    return spec.validate()


def _node(name: str, pid: int = 100) -> NodeRecord:
    return NodeRecord(
        host=name,
        address="127.0.0.1",
        slots=1,
        pid=1,
        worker_pids=[pid],
        started=NOW - 100,
        labels={"zone": "z", "rack": RACKS[name], "host": name},
    )


def _beat(
    generation: int,
    step: int = 10,
    *,
    beat: float = NOW,
    step_time: float = NOW,
    pid: int = 100,
    rank: int = 0,
) -> ProgressRecord:
    return ProgressRecord(
        step=step,
        generation=generation,
        rank=rank,
        world_size=2,
        pid=pid,
        beat=beat,
        step_time=step_time,
    )


def _plan(generation: int, *nodes: str) -> Plan:
    return Plan(
        generation,
        [Member(n, i, 1, {"zone": "z", "rack": RACKS[n], "host": n}) for i, n in enumerate(nodes)],
    )


def _world(
    nodes: list[str], plan: Plan | None = None, *, mono: float = 50.0, **kw: object
) -> World:
    generation = plan.generation if plan else 0
    world = World(now=NOW, mono=mono, plan=plan)
    world.nodes = {n: _node(n) for n in nodes}
    world.progress = {keys.worker_id(n, 0): _beat(generation) for n in nodes}
    for key, value in kw.items():
        setattr(world, key, value)
    return world


def _report(
    step: int = 10, *, planned: bool = False, user_error: bool = False, reason: str = "peer gone"
) -> BreakReport:
    return BreakReport(step=step, reason=reason, planned=planned, at=NOW, user_error=user_error)


@dataclass
class Run:
    spec: JobSpec
    memory: policy.Memory = field(default_factory=policy.Memory)
    status: JobStatus = field(default_factory=lambda: JobStatus("job", JobPhase.RUNNING))
    actions: list[Action] = field(default_factory=list)

    def tick(self, world: World) -> list[Action]:
        decision = policy.decide(self.spec, self.memory, self.status, world)
        self.memory, self.status, self.actions = decision.memory, decision.status, decision.actions
        return self.actions

    def plans(self) -> list[Plan]:
        return [a.plan for a in self.actions if isinstance(a, PublishPlan)]

    def of(self, kind: type) -> list:
        return [a for a in self.actions if isinstance(a, kind)]


def _order(plan: Plan) -> list[str]:
    return [m.node for m in plan.members]


# ----------------------------------------------------------------------------- scenarios


def start_in_topology_order() -> None:
    run = Run(_spec(), status=JobStatus("job"))
    run.tick(_world(["b", "a", "c"]))
    (plan,) = run.plans()
    assert plan.generation == 1
    assert _order(plan) == ["a", "c"]  # both in rack r1: the ring stays in one rack
    assert plan.spares == ["b"]
    assert run.status.phase is JobPhase.RUNNING


def node_death_refused_probe_is_replaced_from_its_rack() -> None:
    run = Run(_spec())
    plan = _plan(1, "a", "b")
    # c (rack r1) sorts first among the spares; b was in rack r2, so d takes its place
    world = _world(["a", "b", "c", "d"], plan, reports={"a-0": _report()}, dead={"b"})
    run.tick(world)
    (declared,) = run.of(DeclareFailed)
    assert declared.nodes == {"b"} and declared.agent_gone == {"b"}
    (new,) = run.plans()
    assert new.generation == 2 and _order(new) == ["a", "d"]
    assert "d replaces b" in new.reason
    assert run.status.phase is JobPhase.RECOVERING and run.status.recoveries == 1
    assert run.status.failed_nodes == ["b"] and run.status.spare_nodes == ["c"]
    # the plan goes out before the failure is recorded (its cause takes a read of events)
    kinds = [type(a) for a in run.actions]
    assert kinds.index(PublishPlan) < kinds.index(DeclareFailed), kinds


def delayed_sync_places_sites_once_every_registered_node_is_warm() -> None:
    """DiLoCo: a node registered a moment late still gets its place in its site."""

    def world(mono: float, *cold: str) -> World:
        w = _world(["a", "b", "c"], mono=mono)
        for n in cold:
            del w.progress[keys.worker_id(n, 0)]
        return w

    plain = Run(_spec(), status=JobStatus("job"))
    plain.tick(world(50.0, "c"))
    assert len(plain.plans()) == 1  # per-step sync: starts at nodes.max at once
    spec = _spec()
    spec.sync.mode = SyncMode.DILOCO
    run = Run(spec.validate(), status=JobStatus("job"))
    run.tick(world(50.0, "c"))
    assert run.plans() == [] and run.status.phase is JobPhase.PENDING
    run.tick(world(51.0))
    (plan,) = run.plans()
    assert len(plan.members) == 2 and plan.spares
    # a node that never warms: the last call starts without it
    run = Run(spec, status=JobStatus("job"))
    run.tick(world(50.0, "c"))
    run.tick(world(50.0 + spec.rendezvous.last_call_timeout.total_seconds(), "c"))
    (plan,) = run.plans()
    assert _order(plan) == ["a", "b"] and plan.spares == []


def silent_node_gets_the_report_grace() -> None:
    run = Run(_spec())
    plan = _plan(1, "a", "b")
    run.tick(_world(["a", "b", "c"], plan, mono=50.0, reports={"a-0": _report()}))
    assert run.plans() == [] and run.status.phase is JobPhase.RECOVERING
    run.tick(_world(["a", "b", "c"], plan, mono=50.5, reports={"a-0": _report()}))
    assert run.plans() == []
    run.tick(_world(["a", "b", "c"], plan, mono=51.1, reports={"a-0": _report()}))
    (new,) = run.plans()
    assert _order(new) == ["a", "c"]
    assert "no report from b" in run.of(DeclareFailed)[0].why


def late_reporters_whose_agents_answer_are_not_replaced() -> None:
    """At scale the survivors' reports land over seconds: a refused probe is replaced at
    once, and members whose agents answered keep their places."""
    run = Run(_spec(min_nodes=4, max_nodes=4))
    plan = _plan(1, "a", "b", "c", "d")
    world = _world(["a", "b", "c", "d", "e"], plan, reports={"a-0": _report()})
    world.dead, world.alive = {"b"}, {"c", "d"}
    run.tick(world)  # no REPORT_GRACE: every silent member is accounted for
    (declared,) = run.of(DeclareFailed)
    assert declared.nodes == {"b"} and "agent of b gone" in declared.why
    (new,) = run.plans()
    assert set(_order(new)) == {"a", "c", "d", "e"}


def a_silent_member_that_did_not_answer_waits_for_the_grace() -> None:
    run = Run(_spec(min_nodes=4, max_nodes=4))
    plan = _plan(1, "a", "b", "c", "d")
    reports = {"a-0": _report()}
    # b refused, c answered, d's probe got no answer (a partition, or an overloaded host)
    run.tick(
        _world(
            ["a", "b", "c", "d", "e", "f"],
            plan,
            mono=50.0,
            reports=reports,
            dead={"b"},
            alive={"c"},
        )
    )
    assert run.plans() == []
    run.tick(
        _world(
            ["a", "b", "c", "d", "e", "f"],
            plan,
            mono=51.1,
            reports=reports,
            dead={"b"},
            alive={"c"},
        )
    )
    (declared,) = run.of(DeclareFailed)
    assert declared.nodes == {"b", "d"}  # c, late but alive, keeps its place
    assert set(_order(run.plans()[0])) == {"a", "c", "e", "f"}


def silent_members_that_all_answer_are_replaced_after_the_grace() -> None:
    """Agents alive but workers silent (a worker died, not the node): after the grace
    they are replaced, as before."""
    run = Run(_spec())
    plan = _plan(1, "a", "b")
    run.tick(_world(["a", "b", "c"], plan, mono=50.0, reports={"a-0": _report()}, alive={"b"}))
    assert run.plans() == []
    run.tick(_world(["a", "b", "c"], plan, mono=51.1, reports={"a-0": _report()}, alive={"b"}))
    (new,) = run.plans()
    assert _order(new) == ["a", "c"] and "no report from b" in run.of(DeclareFailed)[0].why


def no_spare_in_the_rack_reorders_the_ring() -> None:
    run = Run(_spec(min_nodes=5, max_nodes=5))
    plan = _plan(1, "a", "c", "f", "b", "d")  # r1 r1 r1 r2 r2: two crossings
    # c (r1, mid-group) dies; the only warm spare, e, is in r2: in c's slot the
    # ring would cross racks four times, so the ranks are re-ordered
    world = _world(["a", "b", "c", "d", "e", "f"], plan, dead={"c"})
    world.reports = {w: _report() for w in ("a-0", "f-0", "b-0", "d-0")}
    run.tick(world)
    (new,) = run.plans()
    assert set(_order(new)) == {"a", "f", "b", "d", "e"}
    racks = [RACKS[n] for n in _order(new)]
    assert ring_crossings(racks) == min_ring_crossings(racks) == 2
    assert ring_crossings(["r1", "r2", "r1", "r2", "r2"]) == 4  # what the slot would give
    assert [m.rank_base for m in new.members] == [0, 1, 2, 3, 4]


def a_spare_from_another_rack_keeps_the_slot_when_the_ring_stays_short() -> None:
    run = Run(_spec(min_nodes=4, max_nodes=4))
    plan = _plan(1, "a", "c", "b", "d")  # r1 r1 r2 r2
    world = _world(["a", "b", "c", "d", "e"], plan, dead={"a"})
    world.reports = {w: _report() for w in ("c-0", "b-0", "d-0")}
    run.tick(world)
    (new,) = run.plans()
    assert _order(new) == ["e", "c", "b", "d"]  # r2 r1 r2 r2: still two crossings


def lease_expiry_preempted_node_is_replaced() -> None:
    run = Run(_spec())
    plan = _plan(1, "a", "b")
    run.tick(_world(["a", "c", "d"], plan))  # b's registration is gone (preempted, revoked)
    (new,) = run.plans()
    assert _order(new) == ["a", "d"]
    assert "lease expired: b" in run.of(DeclareFailed)[0].why


def a_member_whose_watch_closed_is_replaced_before_any_report() -> None:
    """The agent's watch connection closed unannounced: no report, no grace, even in an
    outage's grace; a spare whose watch closed is no spare."""
    run = Run(_spec())
    plan = _plan(1, "a", "b")
    # c sorts first and shares a's rack, d shares b's: c's agent is gone too
    closed = {"b": NOW - 0.2, "c": NOW - 5}
    run.tick(_world(["a", "b", "c", "d"], plan, closed=closed, silence=(49.0, 8.0)))
    (declared,) = run.of(DeclareFailed)
    assert declared.nodes == {"b"} and declared.agent_gone == {"b"}
    assert declared.seen_at == NOW - 0.2  # the recovery is timed from the close
    assert declared.why == "agent of b gone (its liveness watch closed)"
    (new,) = run.plans()
    assert _order(new) == ["a", "d"] and "c" not in new.spares
    assert run.status.recoveries == 1 and "c" not in run.status.spare_nodes
    # the heartbeats' step (10) was stale: a worker restored at step 12 in generation 2 has
    # not trained again until it completed a step there
    later = _world(["a", "d"], new, mono=51.0 + policy.OUTAGE_GRACE.total_seconds())
    later.progress = {w: _beat(2, step=12) for w in ("a-0", "d-0")}
    for p in later.progress.values():
        p.telemetry = Telemetry(generation=2, restored_step=12)
    run.tick(later)
    assert run.status.phase is JobPhase.RECOVERING and run.of(Recovered) == []
    later.progress["a-0"].telemetry.first_step_at = NOW
    later.progress["d-0"].telemetry.first_step_at = NOW
    run.tick(later)
    assert run.status.phase is JobPhase.RUNNING and len(run.of(Recovered)) == 1
    # reports that land afterwards name the closed watch, and wait for no grace either
    run = Run(_spec())
    world = _world(["a", "b", "d"], plan, reports={"a-0": _report()}, closed={"b": NOW})
    run.tick(world)
    assert run.of(DeclareFailed)[0].why == "agent of b gone (its liveness watch closed)"


def _later(world: World, seconds: float, probed: bool = True) -> None:
    """``seconds`` on; the quiet workers' agents probed again meanwhile (``probed``)."""
    world.mono += seconds
    world.now += seconds
    if probed:
        world.probed_at = {n: world.mono - 0.01 for n in world.answering}


def _watched(run: Run, world: World) -> None:
    """Tick on ``world``, then again once its silences were watched long enough."""
    run.tick(world)
    assert run.of(KillWorker) == []  # seen silent once: not yet a hang
    _later(world, hangs.confirm_after(run.spec), probed=False)
    run.tick(world)
    assert run.of(KillWorker) == []  # its agent was not asked again yet
    _later(world, 0.1)
    run.tick(world)


def hung_worker_is_killed_by_pid() -> None:
    run = Run(_spec(hang_timeout=timedelta(seconds=60)))
    plan = _plan(1, "a", "b")
    world = _world(["a", "b"], plan)
    world.nodes["b"] = _node("b", pid=4242)
    world.progress["b-0"] = _beat(1, beat=NOW - 30, step_time=NOW - 120, pid=4242)
    world.answering = {"b"}  # its agent answers: the silence is the worker's own
    _watched(run, world)
    (kill,) = run.of(KillWorker)
    assert kill.node == "b" and kill.command.pid == 4242 and kill.command.local_rank == 0
    run.tick(world)  # told once, not on every tick
    assert run.of(KillWorker) == []
    world.now += 30
    run.tick(world)  # nor again later: its agent kills it, or is gone itself
    assert run.of(KillWorker) == []


def exited_worker_is_not_called_hung() -> None:
    """Its agent restarted it: the registration lists the new process, and the old
    one's last beat goes stale in the node's record until the new one beats."""
    run = Run(_spec(hang_timeout=timedelta(seconds=60)))
    world = _world(["a", "b"], _plan(1, "a", "b"))
    world.nodes["b"] = _node("b", pid=4343)  # restarted: a new pid
    world.progress["b-0"] = _beat(1, beat=NOW - 30, step_time=NOW - 120, pid=4242)
    world.answering = {"b"}
    run.tick(world)
    assert run.of(KillWorker) == []


def frozen_worker_is_killed_without_waiting_for_hang_timeout() -> None:
    """A SIGSTOPped worker's heartbeat stops with it: 3 silent intervals are enough."""
    run = Run(_spec(hang_timeout=timedelta(seconds=60), heartbeat_interval=timedelta(seconds=0.5)))
    plan = _plan(1, "a", "b")
    world = _world(["a", "b"], plan)
    world.nodes["b"] = _node("b", pid=77)  # the process its agent runs now
    world.progress["b-0"] = _beat(1, beat=NOW - 2, step_time=NOW - 2, pid=77)  # 4 beats missed
    world.answering = {"b"}
    _watched(run, world)
    (kill,) = run.of(KillWorker)
    assert kill.command.pid == 77 and kill.silent_since == NOW - 2


def _b_silent_for(seconds: float) -> tuple[Run, World, JobSpec]:
    """Beats every 0.5 s; b's only worker (pid 77) silent for ``seconds``, its agent
    answering."""
    spec = _spec(hang_timeout=timedelta(seconds=60), heartbeat_interval=timedelta(seconds=0.5))
    world = _world(["a", "b"], _plan(1, "a", "b"))
    world.nodes["b"] = _node("b", pid=77)
    world.progress["b-0"] = _beat(1, beat=NOW - seconds, step_time=NOW - 5, pid=77)
    world.answering = {"b"}
    return Run(spec), world, spec


def _a_beats_on(run: Run, world: World, seconds: float) -> None:
    """Tick ``seconds`` later, a's worker beating, b's agent probed again meanwhile."""
    _later(world, seconds)
    world.progress["a-0"].beat = world.now
    run.tick(world)


def a_silence_that_ends_within_the_watch_is_not_a_hang() -> None:
    """After a stall of the whole machine every beat is old; a worker whose heartbeat
    thread was held up a little longer beats again before the watch ends."""
    run, world, spec = _b_silent_for(2.2)
    run.tick(world)
    assert run.of(KillWorker) == []  # the first sighting after the stall
    world.mono += hangs.confirm_after(spec) / 2
    world.progress["b-0"] = _beat(1, beat=NOW, step_time=NOW - 5, pid=77)  # it beats again
    run.tick(world)
    world.now += 2.2  # b silent again: a new watch, not one from the first sighting
    _a_beats_on(run, world, hangs.confirm_after(spec))
    assert run.of(KillWorker) == []
    _a_beats_on(run, world, hangs.confirm_after(spec))
    assert len(run.of(KillWorker)) == 1


def a_gap_in_the_controllers_ticks_starts_the_watch_again() -> None:
    """Seen silent, then the controller itself is held up: on its next tick the
    silence may be the machine's stall; it is watched afresh."""
    run, world, spec = _b_silent_for(2.0)
    run.tick(world)
    _a_beats_on(run, world, hangs.STALE_BEATS * 0.5 + 0.1)  # no tick between: its own stall
    assert run.of(KillWorker) == []
    _a_beats_on(run, world, hangs.confirm_after(spec))
    assert len(run.of(KillWorker)) == 1


def node_of_a_killed_hung_worker_is_replaced_without_the_report_grace() -> None:
    """The killed worker cannot report: its survivors' report is enough."""
    run = Run(_spec(heartbeat_interval=timedelta(seconds=0.5)))
    plan = _plan(1, "a", "b")
    world = _world(["a", "b", "c"], plan, mono=50.0)
    world.nodes["b"] = _node("b", pid=77)  # the process its agent runs now
    world.progress["b-0"] = _beat(1, beat=NOW - 2, step_time=NOW - 2, pid=77)
    world.answering = {"b"}
    _watched(run, world)
    assert len(run.of(KillWorker)) == 1
    later = world.mono + 0.2
    run.tick(_world(["a", "b", "c"], plan, mono=later, reports={"a-0": _report()}))
    (new,) = run.plans()  # at once, not after REPORT_GRACE
    assert _order(new) == ["a", "c"]
    assert "a worker of b hung and was killed" in run.of(DeclareFailed)[0].why


def quiet_worker_of_an_unreachable_node_is_not_killed() -> None:
    """Cut off by a partition, the node's agent does not answer either: its lease and
    its peers' reports settle it; a kill would only reach it when the link is back."""
    run = Run(_spec(hang_timeout=timedelta(seconds=60), heartbeat_interval=timedelta(seconds=0.5)))
    plan = _plan(1, "a", "b")
    world = _world(["a", "b"], plan)
    world.nodes["b"] = _node("b", pid=77)  # the process its agent runs now
    world.progress["b-0"] = _beat(1, beat=NOW - 2, step_time=NOW - 2, pid=77)
    run.tick(world)  # world.answering is empty: b's agent did not answer
    assert run.of(KillWorker) == []


def every_heartbeat_stopped_is_not_a_hang() -> None:
    run = Run(_spec(hang_timeout=timedelta(seconds=60)))
    plan = _plan(1, "a", "b")
    world = _world(["a", "b"], plan)
    for w in ("a-0", "b-0"):
        world.progress[w] = _beat(1, beat=NOW - 30, step_time=NOW - 120)
    run.tick(world)
    assert run.of(KillWorker) == []


def outage_pauses_and_holds_fire_for_the_grace() -> None:
    run = Run(_spec())
    plan = _plan(1, "a", "b")
    grace = policy.OUTAGE_GRACE.total_seconds()
    run.tick(_world(["a", "c"], plan, mono=50.0, silence=(49.0, 8.0)))  # b's lease ran out
    assert run.status.phase is JobPhase.PAUSED and run.plans() == []
    run.tick(_world(["a", "c"], plan, mono=50.0 + grace / 2, silence=(49.0, 8.0)))
    assert run.status.phase is JobPhase.PAUSED and run.plans() == []
    run.tick(_world(["a", "c"], plan, mono=50.0 + grace + 0.1, silence=(49.0, 8.0)))
    assert next(a.phase for a in run.of(PhaseChanged)) is JobPhase.RUNNING
    assert _order(run.plans()[0]) == ["a", "c"]


def scale_down_to_nodes_min_without_spares() -> None:
    run = Run(_spec(min_nodes=1, max_nodes=2, spares=0))
    plan = _plan(1, "a", "b")
    run.tick(_world(["a", "b"], plan, reports={"a-0": _report()}, dead={"b"}))
    (new,) = run.plans()
    assert _order(new) == ["a"] and new.reason == "scaled down to 1 nodes"


def every_member_reporting_the_break_regroups_the_same_nodes() -> None:
    run = Run(_spec())
    timed_out = _report(reason="step boundary 160 failed: timed out waiting 5000ms")
    world = _world(
        ["a", "b", "c"], _plan(1, "a", "b"), reports={"a-0": timed_out, "b-0": timed_out}
    )
    run.tick(world)
    (new,) = run.plans()
    assert _order(new) == ["a", "b"] and new.spares == ["c"]
    why = "every member reported the break and none is gone (a collective failed or timed out)"
    assert new.reason == f"the same nodes again: {why}"
    (declared,) = run.of(DeclareFailed)
    assert declared.nodes == frozenset() and declared.why == why


def a_member_whose_agent_went_after_reporting_is_replaced() -> None:
    run = Run(_spec())
    reports = {"a-0": _report(), "b-0": _report()}
    run.tick(_world(["a", "b", "c"], _plan(1, "a", "b"), reports=reports, dead={"b"}))
    (new,) = run.plans()
    assert _order(new) == ["a", "c"]
    (declared,) = run.of(DeclareFailed)
    assert declared.nodes == frozenset({"b"})


def a_node_back_after_a_scale_down_rejoins_with_a_new_agent() -> None:
    run = Run(_spec(min_nodes=1, max_nodes=2, spares=0))
    run.tick(_world(["a", "b"], _plan(1, "a", "b"), reports={"a-0": _report()}, dead={"b"}))
    (down,) = run.plans()
    assert _order(down) == ["a"]
    world = _world(["a"], down, mono=60.0)
    world.progress["a-0"] = _beat(2, step=12)  # generation 2 trains
    run.tick(world)
    assert run.status.phase is JobPhase.RUNNING and run.plans() == []
    # b's failed agent's registration, its beats still fresh: not taken back
    world = _world(["a", "b"], down, mono=61.0)
    world.progress["a-0"] = _beat(2, step=13)
    run.tick(world)
    assert run.plans() == [] and run.status.phase is JobPhase.RUNNING
    # b's agent started again (the node is back): the generation grows to nodes.max
    world.nodes["b"] = dataclasses.replace(_node("b"), started=NOW - 1)
    world.mono = 62.0
    run.tick(world)
    (up,) = run.plans()
    assert _order(up) == ["a", "b"] and up.generation == 3
    assert up.reason == "scaled up to 2 nodes: b joined"
    assert run.status.phase is JobPhase.RECOVERING
    assert [(e.type, e.data) for e in run.of(Emit)] == [("ScaledUp", {"nodes": ["b"]})]
    assert run.of(DeclareFailed) == [] and run.status.recoveries == 1  # the scale-down's


def a_node_late_for_the_start_joins_up_to_nodes_max() -> None:
    run = Run(_spec(min_nodes=1, max_nodes=2, spares=0))
    run.tick(_world(["a", "b", "c"], _plan(1, "a")))
    (up,) = run.plans()
    assert _order(up) == ["a", "c"]  # one slot: the first in topology order (a's rack)
    assert up.reason == "scaled up to 2 nodes: c joined" and up.spares == ["b"]


def a_generation_at_nodes_max_keeps_its_spares() -> None:
    run = Run(_spec(min_nodes=1, max_nodes=2, spares=1))
    run.tick(_world(["a", "b", "c"], _plan(1, "a", "b")))
    assert run.plans() == [] and run.status.phase is JobPhase.RUNNING


def restart_tier_does_not_scale_up() -> None:
    run = Run(_spec(min_nodes=1, max_nodes=2, spares=0, recovery=RecoveryMode.RESTART))
    run.tick(_world(["a", "b"], _plan(1, "a")))
    assert run.plans() == []


def no_spare_left_waits_then_fails() -> None:
    run = Run(_spec(min_nodes=2, max_nodes=2, spares=0))
    plan = _plan(1, "a", "b")
    run.tick(_world(["a", "b"], plan, mono=50.0, reports={"a-0": _report()}, dead={"b"}))
    assert run.plans() == [] and run.status.phase is JobPhase.RECOVERING
    assert "waiting up to 30s" in run.status.message
    run.tick(_world(["a", "b"], plan, mono=81.0, reports={"a-0": _report()}, dead={"b"}))
    assert run.status.phase is JobPhase.FAILED
    assert "rendezvous.join_timeout" in run.status.message


def a_replacement_that_waited_for_a_spare_says_so() -> None:
    run = Run(_spec())
    plan = _plan(1, "a", "b")
    reports = {"a-0": _report()}
    world = _world(["a", "b", "c"], plan, mono=50.0, reports=reports, dead={"b"})
    del world.progress["c-0"]  # c's agent registered; its worker has not beaten yet
    run.tick(world)
    assert run.plans() == [] and run.status.phase is JobPhase.RECOVERING
    run.tick(_world(["a", "b", "c"], plan, mono=62.5, reports=reports, dead={"b"}))
    (new,) = run.plans()
    assert _order(new) == ["a", "c"]
    assert new.reason == "c replaces b; the spare was still starting: 12.5s"
    # the recovery record gets the wait apart from detection
    assert run.of(DeclareFailed)[-1].spare_wait_s == pytest.approx(12.5)
    # a spare warm at once: no wait is named; a node that registered during the wait
    # was no spare then
    run.tick(_world(["a", "c", "d"], new, mono=90.0, reports=reports, dead={"c"}))
    assert run.plans()[0].reason == "d replaces c"
    assert run.of(DeclareFailed)[-1].spare_wait_s == 0.0
    world = _world(["a", "d"], run.plans()[0], mono=100.0, reports=reports, dead={"d"})
    run.tick(world)
    assert run.plans() == []
    world = _world(["a", "d", "e"], world.plan, mono=104.0, reports=reports, dead={"d"})
    world.nodes["e"].started = NOW - 1.0  # 3 s into the wait
    run.tick(world)
    assert run.plans()[0].reason == "e replaces d; no spare for 4.0s"
    assert run.of(DeclareFailed)[-1].spare_wait_s == pytest.approx(4.0)


def a_start_the_leader_before_did_not_record_runs_and_ends() -> None:
    # the leader published generation 1 and ended before it wrote the status
    run = Run(_spec(), status=JobStatus("job", JobPhase.PENDING))
    plan = _plan(1, "a", "b")
    run.tick(_world(["a", "b", "c"], plan))
    assert run.status.phase is JobPhase.RUNNING and run.plans() == []
    assert [a.phase for a in run.of(PhaseChanged)] == [JobPhase.RUNNING]
    done = DoneRecord(step=5, generation=1, at=NOW)
    run.tick(_world(["a", "b", "c"], plan, done={"a-0": done, "b-0": done}))
    assert run.status.phase is JobPhase.SUCCEEDED


def user_error_restarts_then_fails_without_a_recovery() -> None:
    run = Run(_spec(max_restarts=1))
    error = _report(step=5, user_error=True, reason="RuntimeError: socket timed out")
    run.tick(_world(["a", "b", "c"], _plan(1, "a", "b"), reports={"a-0": error}))
    (restart,) = run.plans()
    assert restart.generation == 2 and _order(restart) == ["a", "b"]
    assert [e.type for e in run.of(Emit)] == ["Restart"]
    assert run.of(DeclareFailed) == [] and run.status.phase is JobPhase.RUNNING
    run.tick(_world(["a", "b", "c"], _plan(2, "a", "b"), reports={"b-0": error}))
    assert run.plans() == []
    assert run.status.phase is JobPhase.FAILED
    assert "worker b-0 failed at step 5: RuntimeError: socket timed out" in run.status.message
    assert run.status.recoveries == 0 and run.status.failed_nodes == []


def a_peer_failure_beside_a_user_error_is_the_user_error() -> None:
    run = Run(_spec(max_restarts=0))
    reports = {"a-0": _report(), "b-0": _report(user_error=True, reason="ValueError: bad")}
    run.tick(_world(["a", "b"], _plan(1, "a", "b"), reports=reports))
    assert run.status.phase is JobPhase.FAILED and "ValueError: bad" in run.status.message


def a_user_error_beside_a_dead_node_is_a_node_failure() -> None:
    run = Run(_spec(max_restarts=0))
    reports = {"a-0": _report(user_error=True, reason="RuntimeError: read failed")}
    run.tick(_world(["a", "b", "c"], _plan(1, "a", "b"), reports=reports, dead={"b"}))
    assert run.status.phase is JobPhase.RECOVERING
    assert _order(run.plans()[0]) == ["a", "c"]


def every_node_failing_before_its_first_step_fails_the_job() -> None:
    run = Run(_spec(), status=JobStatus("job"))
    cannot = "exit code 2: python: can't open file '/w/trian.py'"
    world = _world(["a"])  # a registered; b's agent already gave up
    world.progress = {}
    world.startup_failures = {"a": cannot}
    run.tick(world)  # one node known, two needed: not yet
    assert run.status.phase is JobPhase.PENDING
    world.startup_failures = {"a": cannot, "b": cannot}
    run.tick(world)
    assert run.status.phase is JobPhase.FAILED
    assert "(a, b) failed before their first step: " + cannot in run.status.message


def nodes_that_never_come_up_fail_the_job_after_join_timeout() -> None:
    run = Run(_spec(), status=JobStatus("job"))
    world = _world(["a", "b"], mono=10.0)
    world.progress = {}  # registered, but no worker ever beat
    run.tick(world)
    assert run.status.phase is JobPhase.PENDING
    run.tick(dataclasses.replace(world, mono=41.0))
    assert run.status.phase is JobPhase.FAILED
    assert "only 0 of the 2 nodes needed were ready for 30s" in run.status.message


def one_node_failing_at_start_does_not_fail_the_job() -> None:
    run = Run(_spec(), status=JobStatus("job"))
    world = _world(["a", "b"])
    world.progress = {"b-0": _beat(0)}
    world.startup_failures = {"a": "exit code 1: ImportError: no module named foo"}
    run.tick(world)
    assert run.status.phase is JobPhase.PENDING
    world.startup_failures["b"] = "exit code -9 (SIGKILL)"  # not the same way
    world.progress = {}
    run.tick(world)
    assert run.status.phase is JobPhase.PENDING


def planned_switch_is_not_a_failure() -> None:
    run = Run(_spec())
    reports = {"a-0": _report(planned=True), "b-0": _report(planned=True)}
    run.tick(_world(["a", "b"], _plan(1, "a", "b"), reports=reports))
    assert run.plans() == [] and run.status.phase is JobPhase.RUNNING


def stop_command_reaches_the_workers() -> None:
    run = Run(_spec())
    world = _world(["a", "b"], _plan(1, "a", "b"), commands={"/k/1": CommandRecord("stop")})
    run.tick(world)
    assert run.of(DeleteCommand) == [DeleteCommand("/k/1")]
    (control,) = run.of(WriteControl)
    assert control.control.stop
    done = DoneRecord(step=12, generation=1, at=NOW)
    world = _world(["a", "b"], _plan(1, "a", "b"), done={"a-0": done, "b-0": done})
    world.control.stop = True
    run.tick(world)
    assert run.status.phase is JobPhase.STOPPED  # not Succeeded, though every worker is done
    assert run.status.message == "stopped on request at step 12"


def finished_workers_succeed() -> None:
    run = Run(_spec())
    done = DoneRecord(step=300, generation=1, at=NOW)
    world = _world(["a", "b"], _plan(1, "a", "b"), done={"a-0": done, "b-0": done})
    world.progress = {w: _beat(1, step=299) for w in ("a-0", "b-0")}  # read just before
    run.tick(world)
    assert run.status.phase is JobPhase.SUCCEEDED
    assert run.status.step == 300 and run.status.message == "finished at step 300"


def a_recovery_the_end_overtakes_is_still_recorded() -> None:
    """A new generation that trains to the last step before a tick sees it training: the
    job succeeds and its recovery is closed (its record written) all the same."""
    run = Run(_spec())
    run.status.phase = JobPhase.RECOVERING
    done = DoneRecord(step=300, generation=2, at=NOW)
    plan = _plan(2, "a", "c")
    world = _world(["a", "c"], plan, done={"a-0": done, "c-0": done})
    world.progress = {w: _beat(2, step=300) for w in ("a-0", "c-0")}
    run.tick(world)
    assert run.of(Recovered) == [Recovered(plan)] and run.status.phase is JobPhase.SUCCEEDED


def inputs_are_not_modified() -> None:
    spec, memory, status = _spec(), policy.Memory(), JobStatus("job", JobPhase.RUNNING)
    world = _world(["a", "c", "d"], _plan(1, "a", "b"))
    policy.decide(spec, memory, status, world)
    assert memory == policy.Memory() and status == JobStatus("job", JobPhase.RUNNING)


# -- the restart tier: plain torchrun scripts, no heartbeats, agents speak for workers


def _restart_world(
    nodes: list[str], plan: Plan | None = None, *, launched: int = 0, **kw: object
) -> World:
    """A restart-tier snapshot: registrations (with the generation each agent
    launched), no heartbeats."""
    world = _world(nodes, plan, **kw)
    world.progress = {}
    for n in nodes:
        world.nodes[n] = dataclasses.replace(
            world.nodes[n], recovery="restart", generation=launched, launched_at=NOW
        )
    return world


def _restart_spec(**ft: object) -> JobSpec:
    return _spec(recovery=RecoveryMode.RESTART, **ft)


def restart_tier_refuses_to_start_nodes_that_do_not_share_the_scripts_checkpoint() -> None:
    run = Run(_restart_spec(), status=JobStatus("job"))
    world = _restart_world(["a", "b", "c"])
    for n in ("a", "b"):  # one directory on one machine: one checkpoint
        world.nodes[n] = dataclasses.replace(world.nodes[n], script_storage="h1:/w/snapshot.pt")
    world.nodes["c"] = dataclasses.replace(world.nodes["c"], script_storage="h2:/w/snapshot.pt")
    run.tick(world)
    assert run.plans() == [] and run.status.phase is JobPhase.FAILED
    assert run.status.message.startswith(
        "the script's own checkpoint is not in one place every node reads (a, b at "
        "h1:/w/snapshot.pt; c at h2:/w/snapshot.pt)"
    ), run.status.message
    # nodes that agree, or that do not say (object storage, a path known at run time), start
    world.nodes["c"] = dataclasses.replace(world.nodes["c"], script_storage=None)
    agree = Run(_restart_spec(), status=JobStatus("job"))
    agree.tick(world)
    assert len(agree.plans()) == 1 and agree.status.phase is JobPhase.RUNNING


def restart_tier_starts_without_heartbeats() -> None:
    run = Run(_restart_spec(), status=JobStatus("job"))
    run.tick(_restart_world(["b", "a", "c"]))
    (plan,) = run.plans()
    assert _order(plan) == ["a", "c"] and plan.spares == ["b"]
    # the in-process tier waits for the workers' heartbeats instead
    in_process = Run(_spec(recovery=RecoveryMode.IN_PROCESS), status=JobStatus("job"))
    in_process.tick(_restart_world(["b", "a", "c"]))
    assert in_process.plans() == []


def restart_tier_auto_is_told_by_the_agents() -> None:
    run = Run(_spec(), status=JobStatus("job"))  # submitted as auto, agents resolved it
    assert run.spec.fault_tolerance.recovery is RecoveryMode.AUTO
    run.tick(_restart_world(["a", "b"]))
    assert len(run.plans()) == 1


def restart_tier_dead_node_is_replaced_not_counted_as_a_script_error() -> None:
    run = Run(_restart_spec(max_restarts=0))
    plan = _plan(1, "a", "b")
    # b's agent is gone; a's worker died in the collective b left (exit code 1)
    broken = _report(step=0, user_error=True, reason="a-0 exit code 1: RuntimeError: reset")
    run.tick(_restart_world(["a", "b", "c"], plan, launched=1, reports={"a-0": broken}, dead={"b"}))
    (new,) = run.plans()
    assert _order(new) == ["a", "c"] and "c replaces b" in new.reason
    assert run.of(Emit) == [] and run.status.phase is JobPhase.RECOVERING
    assert run.status.recoveries == 1 and run.memory.user_errors == []


def restart_tier_a_spare_never_takes_rank_0_from_a_survivor() -> None:
    # a (rank 0) dies; c, from a's rack, takes its slot, but a script's DDP broadcasts
    # rank 0's weights and c may have no checkpoint: b, the survivor, becomes rank 0
    broken = _report(step=0, user_error=True, reason="b-0 exit code 1: RuntimeError: reset")
    world = _restart_world(
        ["a", "b", "c"], _plan(1, "a", "b"), launched=1, reports={"b-0": broken}, dead={"a"}
    )
    run = Run(_restart_spec())
    run.tick(world)
    (new,) = run.plans()
    assert _order(new) == ["b", "c"] and "c replaces a" in new.reason
    assert new.member("b") == Member("b", 0, 1, {"zone": "z", "rack": "r2", "host": "b"})
    # the in-process tier keeps the slot: a live peer sends the replacement its state
    in_process = Run(_spec())
    in_process.tick(_world(["b", "c"], _plan(1, "a", "b"), reports={"b-0": _report()}, dead={"a"}))
    (kept,) = in_process.plans()
    assert _order(kept) == ["c", "b"]


def restart_tier_names_the_dead_node_before_the_survivors_error() -> None:
    run = Run(_restart_spec())
    broken = _report(step=0, user_error=True, reason="exit code 1: RuntimeError: reset by peer")
    # a reported; b, silent, not known dead yet: nothing is said about the break yet
    run.tick(
        _restart_world(
            ["a", "b", "c"], _plan(1, "a", "b"), launched=1, mono=50.0, reports={"a-0": broken}
        )
    )
    assert run.of(PhaseChanged) == [] and run.status.phase is JobPhase.RUNNING
    # b's agent refused its probe: b's failure first, a's error after it as its consequence
    run.tick(
        _restart_world(
            ["a", "b", "c"],
            _plan(1, "a", "b"),
            launched=1,
            mono=50.1,
            reports={"a-0": broken},
            dead={"b"},
        )
    )
    kinds = [type(a).__name__ for a in run.actions]
    assert kinds[-3:] == ["PublishPlan", "DeclareFailed", "PhaseChanged"], kinds
    (phase,) = run.of(PhaseChanged)
    assert phase.message == (
        "generation 2: c replaces b (agent of b gone (liveness port refused)); the errors "
        "reported by a followed from it"
    )
    assert "RuntimeError" not in phase.message


def restart_tier_recovers_once_every_member_launched() -> None:
    run = Run(_restart_spec(), status=JobStatus("job", JobPhase.RECOVERING))
    plan = _plan(2, "a", "c")
    world = _restart_world(["a", "c"], plan, launched=2)
    world.nodes["c"] = dataclasses.replace(world.nodes["c"], generation=1)  # not yet
    run.tick(world)
    assert run.of(Recovered) == [] and run.status.phase is JobPhase.RECOVERING
    run.tick(_restart_world(["a", "c"], plan, launched=2))
    assert run.of(Recovered) == [Recovered(plan)]
    assert run.status.phase is JobPhase.RUNNING and "every worker restarted" in run.status.message


def restart_tier_recovery_ends_at_the_scripts_first_output() -> None:
    run = Run(_restart_spec(), status=JobStatus("job", JobPhase.RECOVERING))
    plan = _plan(2, "a", "c")
    world = _restart_world(["a", "c"], plan, launched=2)
    world.nodes["c"] = dataclasses.replace(world.nodes["c"], progress_at=0.0)  # launched, silent
    run.tick(world)
    assert run.of(Recovered) == [] and run.status.phase is JobPhase.RECOVERING
    world.nodes["c"] = dataclasses.replace(world.nodes["c"], progress_at=NOW + 0.3)
    world.nodes["a"] = dataclasses.replace(world.nodes["a"], progress_at=0.0)  # rank 0 prints
    run.tick(world)
    assert run.of(Recovered) == [Recovered(plan)] and run.status.phase is JobPhase.RUNNING


def restart_tier_script_error_names_the_first_report_and_restarts() -> None:
    run = Run(_restart_spec(max_restarts=1))
    plan = _plan(1, "a", "b")
    own = BreakReport(
        step=0, reason="exit code 1: ValueError: bad batch", planned=False, at=NOW, user_error=True
    )
    peer = BreakReport(
        step=0,
        reason="exit code 1: RuntimeError: reset by peer",
        planned=False,
        at=NOW + 0.05,
        user_error=True,
    )
    # a reported first; b, not known dead, gets the grace to report
    run.tick(_restart_world(["a", "b"], plan, launched=1, mono=50.0, reports={"a-0": peer}))
    assert run.plans() == [] and run.of(Emit) == []
    reports = {"a-0": peer, "b-0": own}
    run.tick(_restart_world(["a", "b"], plan, launched=1, mono=50.2, reports=reports))
    (restart,) = run.plans()
    assert _order(restart) == ["a", "b"] and restart.generation == 2
    (emit,) = run.of(Emit)
    assert emit.type == "Restart" and "ValueError: bad batch" in emit.message
    run.tick(_restart_world(["a", "b"], _plan(2, "a", "b"), launched=2, reports=reports))
    assert run.status.phase is JobPhase.FAILED
    assert run.status.message.startswith(
        "worker b-0 failed in generation 2: exit code 1: ValueError: bad batch (an error in "
    )


def restart_tier_silent_member_after_the_grace_is_a_restart() -> None:
    run = Run(_restart_spec())
    plan = _plan(1, "a", "b")
    error = _report(step=0, user_error=True, reason="a-0 exit code 1: KeyError: 'x'")
    run.tick(_restart_world(["a", "b"], plan, launched=1, mono=50.0, reports={"a-0": error}))
    assert run.plans() == []
    run.tick(_restart_world(["a", "b"], plan, launched=1, mono=51.1, reports={"a-0": error}))
    (restart,) = run.plans()
    assert _order(restart) == ["a", "b"] and run.of(DeclareFailed) == []


def restart_tier_finishes_when_every_worker_exited_0() -> None:
    run = Run(_restart_spec())
    done = DoneRecord(step=0, generation=2, at=NOW)
    run.tick(_restart_world(["a", "c"], _plan(2, "a", "c"), launched=2, done={"a-0": done}))
    assert run.status.phase is JobPhase.RUNNING
    world = _restart_world(
        ["a", "c"], _plan(2, "a", "c"), launched=2, done={"a-0": done, "c-0": done}
    )
    run.tick(world)
    assert run.status.phase is JobPhase.SUCCEEDED
    assert run.status.message == "finished: every worker of generation 2 exited 0"
    assert run.status.recovery == "restart" and run.status.step == 0


def restart_tier_stop_ends_the_job_at_once() -> None:
    run = Run(_restart_spec())
    world = _restart_world(["a", "b"], _plan(1, "a", "b"), launched=1)
    world.control.stop = True
    run.tick(world)
    assert run.status.phase is JobPhase.STOPPED


SCENARIOS: list[Callable[[], None]] = [
    a_start_the_leader_before_did_not_record_runs_and_ends,
    delayed_sync_places_sites_once_every_registered_node_is_warm,
    start_in_topology_order,
    node_death_refused_probe_is_replaced_from_its_rack,
    silent_node_gets_the_report_grace,
    late_reporters_whose_agents_answer_are_not_replaced,
    a_silent_member_that_did_not_answer_waits_for_the_grace,
    silent_members_that_all_answer_are_replaced_after_the_grace,
    no_spare_in_the_rack_reorders_the_ring,
    a_spare_from_another_rack_keeps_the_slot_when_the_ring_stays_short,
    lease_expiry_preempted_node_is_replaced,
    a_member_whose_watch_closed_is_replaced_before_any_report,
    hung_worker_is_killed_by_pid,
    exited_worker_is_not_called_hung,
    frozen_worker_is_killed_without_waiting_for_hang_timeout,
    a_silence_that_ends_within_the_watch_is_not_a_hang,
    a_gap_in_the_controllers_ticks_starts_the_watch_again,
    quiet_worker_of_an_unreachable_node_is_not_killed,
    node_of_a_killed_hung_worker_is_replaced_without_the_report_grace,
    every_heartbeat_stopped_is_not_a_hang,
    outage_pauses_and_holds_fire_for_the_grace,
    scale_down_to_nodes_min_without_spares,
    every_member_reporting_the_break_regroups_the_same_nodes,
    a_member_whose_agent_went_after_reporting_is_replaced,
    a_node_back_after_a_scale_down_rejoins_with_a_new_agent,
    a_node_late_for_the_start_joins_up_to_nodes_max,
    a_generation_at_nodes_max_keeps_its_spares,
    restart_tier_does_not_scale_up,
    no_spare_left_waits_then_fails,
    a_replacement_that_waited_for_a_spare_says_so,
    user_error_restarts_then_fails_without_a_recovery,
    a_peer_failure_beside_a_user_error_is_the_user_error,
    a_user_error_beside_a_dead_node_is_a_node_failure,
    every_node_failing_before_its_first_step_fails_the_job,
    one_node_failing_at_start_does_not_fail_the_job,
    nodes_that_never_come_up_fail_the_job_after_join_timeout,
    planned_switch_is_not_a_failure,
    stop_command_reaches_the_workers,
    finished_workers_succeed,
    a_recovery_the_end_overtakes_is_still_recorded,
    inputs_are_not_modified,
    restart_tier_starts_without_heartbeats,
    restart_tier_refuses_to_start_nodes_that_do_not_share_the_scripts_checkpoint,
    restart_tier_auto_is_told_by_the_agents,
    restart_tier_dead_node_is_replaced_not_counted_as_a_script_error,
    restart_tier_a_spare_never_takes_rank_0_from_a_survivor,
    restart_tier_names_the_dead_node_before_the_survivors_error,
    restart_tier_recovers_once_every_member_launched,
    restart_tier_recovery_ends_at_the_scripts_first_output,
    restart_tier_script_error_names_the_first_report_and_restarts,
    restart_tier_silent_member_after_the_grace_is_a_restart,
    restart_tier_finishes_when_every_worker_exited_0,
    restart_tier_stop_ends_the_job_at_once,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_policy(scenario: Callable[[], None]) -> None:
    scenario()
