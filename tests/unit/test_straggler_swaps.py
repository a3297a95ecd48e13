"""What the controller does about a straggler: a scenario table over the pure decisions.

Each scenario calls :func:`decide_stragglers` with a world snapshot and a watch
that already called a node slow (or not), and checks the actions: a planned
swap with a warm spare, the quarantine and its release, and why a straggler
keeps its slot (no spare, not worth it, only reporting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta

import pytest

from orchestrator.api import JobPhase
from orchestrator.controller.actions import Action, Emit, PublishPlan, ReleaseNode
from orchestrator.controller.commands import take_commands
from orchestrator.controller.plans import is_warm
from orchestrator.controller.straggler_swaps import decide_stragglers
from orchestrator.controller.stragglers import Straggler, StragglerWatch
from orchestrator.controller.world import World
from orchestrator.spec.job import EntrypointSpec, JobSpec, NodesSpec, StragglerAction
from orchestrator.state import keys
from orchestrator.state.records import (
    CommandRecord,
    ControlRecord,
    JobStatus,
    Member,
    NodeRecord,
    Plan,
    ProgressRecord,
)

pytestmark = pytest.mark.unit

NOW = 1_000.0
PLAN = Plan(3, [Member("a", 0, 1, {"rack": "r1"}), Member("b", 1, 1, {"rack": "r2"})], spares=["c"])


def _spec(action: StragglerAction = StragglerAction.SWAP, max_steps: int = 10_000) -> JobSpec:
    spec = JobSpec(
        name="job",
        entrypoint=EntrypointSpec(script="t.py"),
        nodes=NodesSpec(min=2, max=2, spares=1),
        max_steps=max_steps,
    )
    spec.fault_tolerance.stragglers.action = action
    return spec.validate()


def _world(*nodes: str, started: float = 1.0) -> World:
    world = World(now=NOW, mono=50.0, plan=PLAN)
    for n in nodes:
        world.nodes[n] = NodeRecord(
            host=n,
            address="127.0.0.1",
            slots=1,
            pid=1,
            worker_pids=[100],
            started=started,
            labels={"rack": "r1" if n in "ac" else "r2"},
        )
        world.progress[keys.worker_id(n, 0)] = ProgressRecord(
            step=500, generation=3, rank=0, world_size=2, pid=100, beat=NOW, step_time=NOW
        )
    return world


def _slow_b(lost: float = 6.0) -> StragglerWatch:
    """A watch that has called ``b`` 2x as slow as its peer (its windows already judged),
    having cost the job ``lost`` seconds (past the default ``confirm`` of 5 s)."""
    watch = StragglerWatch(_spec().fault_tolerance.stragglers)
    watch.flagged["b"] = Straggler("b", 2.0, 0.1, 0.05, 0.0, 0.05, 3)
    watch.lost["b"] = lost
    return watch


def _status(rate: float = 10.0, step: int = 500) -> JobStatus:
    return JobStatus(
        "job",
        JobPhase.RUNNING,
        step=step,
        steps_per_s=rate,
        active_nodes=["a", "b"],
        spare_nodes=["c"],
    )


def _emitted(actions: list[Action], kind: str) -> list[Emit]:
    return [a for a in actions if isinstance(a, Emit) and a.type == kind]


def a_straggler_is_swapped_for_a_warm_spare_and_quarantined() -> None:
    watch, status, world = _slow_b(), _status(), _world("a", "b", "c")
    actions = decide_stragglers(_spec(), watch, status, world, [])
    (publish,) = [a for a in actions if isinstance(a, PublishPlan)]
    assert [m.node for m in publish.plan.members] == ["a", "c"] and publish.plan.generation == 4
    assert publish.plan.spares == [] and "c replaces b (a straggler, 2.00x" in publish.plan.reason
    (swapped,) = _emitted(actions, "StragglerSwapped")
    assert "b is quarantined: not a spare again until its agent restarts or " in swapped.message
    assert "`ringmaster release job b`" in swapped.message
    assert status.quarantined == ["b"] and watch.quarantined == {"b": 1.0}
    # the quarantined node is never a warm spare again (the policy's replacements too)
    world.quarantined = set(watch.quarantined)
    assert not is_warm(_spec(), world, "b", False) and is_warm(_spec(), world, "a", False)


def a_swap_waits_until_the_straggler_has_cost_the_job_confirm() -> None:
    watch, world = _slow_b(lost=4.9), _world("a", "b", "c")
    assert decide_stragglers(_spec(), watch, _status(), world, []) == []  # nothing said yet
    watch.lost["b"] = 5.0
    actions = decide_stragglers(_spec(), watch, _status(), world, [])
    (swapped,) = _emitted(actions, "StragglerSwapped")
    assert "it had cost the job 5.0s" in swapped.message
    spec = _spec()
    spec.fault_tolerance.stragglers.confirm = timedelta(0)  # 0: swapped at the call
    assert _emitted(
        decide_stragglers(spec, _slow_b(lost=0.0), _status(), world, []), "StragglerSwapped"
    )


def without_a_spare_the_straggler_keeps_its_slot_said_once() -> None:
    watch, world = _slow_b(), _world("a", "b")
    first = decide_stragglers(_spec(), watch, _status(), world, [])
    assert not [a for a in first if isinstance(a, PublishPlan)]
    (kept,) = _emitted(first, "StragglerKept")
    assert kept.message == "b keeps its slot: no warm spare to take its slot: reported only"
    assert decide_stragglers(_spec(), watch, _status(), world, []) == []


def with_sites_of_one_size_a_straggler_takes_a_spare_of_its_own_site_only() -> None:
    # a model sharded in each site: a spare of another site would leave them uneven
    world = _world("a", "b", "c")
    for n, zone in (("a", "x"), ("b", "y"), ("c", "x")):
        world.nodes[n].labels = {"zone": zone}
    kept = decide_stragglers(_spec(), _slow_b(), _status(), world, [], equal_sites=True)
    assert not [a for a in kept if isinstance(a, PublishPlan)]
    assert _emitted(kept, "StragglerKept")
    world.nodes["c"].labels = {"zone": "y"}
    swapped = decide_stragglers(_spec(), _slow_b(), _status(), world, [], equal_sites=True)
    (publish,) = [a for a in swapped if isinstance(a, PublishPlan)]
    assert [m.node for m in publish.plan.members] == ["a", "c"]


def a_swap_that_does_not_pay_is_not_made() -> None:
    # 20 steps left at 10 steps/s, 2x slow: 1 s saved, against a 2 s cost
    watch, world = _slow_b(), _world("a", "b", "c")
    actions = decide_stragglers(_spec(max_steps=520), watch, _status(), world, [])
    assert not [a for a in actions if isinstance(a, PublishPlan)]
    (kept,) = _emitted(actions, "StragglerKept")
    assert "a swap would save 1.0s over the rest of the job against its cost of 2.0s" in (
        kept.message
    )
    # the job's own last recovery is the cost when it has one
    spec = _spec(max_steps=1_000)  # 500 steps left: 25 s saved
    spec.fault_tolerance.stragglers.min_gain = timedelta(seconds=20)
    status = dataclasses.replace(_status(), last_recovery={"total_s": 6.0})
    assert not [
        a
        for a in decide_stragglers(spec, _slow_b(), status, world, [])
        if isinstance(a, PublishPlan)
    ]
    status.last_recovery = {"total_s": 4.0}
    assert [
        a
        for a in decide_stragglers(spec, _slow_b(), status, world, [])
        if isinstance(a, PublishPlan)
    ]


def report_only_never_swaps() -> None:
    watch, world = _slow_b(), _world("a", "b", "c")
    actions = decide_stragglers(_spec(StragglerAction.REPORT), watch, _status(), world, [])
    assert actions == [] and watch.quarantined == {}


def nothing_is_decided_while_the_policy_changes_the_group() -> None:
    watch, world = _slow_b(), _world("a", "b", "c")
    busy: list[Action] = [PublishPlan(dataclasses.replace(PLAN, generation=4))]
    assert decide_stragglers(_spec(), watch, _status(), world, busy) == []
    recovering = dataclasses.replace(_status(), phase=JobPhase.RECOVERING)
    assert decide_stragglers(_spec(), watch, recovering, world, []) == []


def an_operator_releases_a_quarantined_node() -> None:
    watch, world = _slow_b(), _world("a", "b", "c")
    watch.quarantined["d"] = 1.0
    command = {"k1": CommandRecord("release", {"node": "d"})}
    taken, _ = take_commands(command, ControlRecord())
    assert ReleaseNode("d") in taken
    actions = decide_stragglers(_spec(StragglerAction.REPORT), watch, _status(), world, taken)
    (released,) = _emitted(actions, "NodeReleased")
    assert released.message == "d released by an operator: it may be a spare again"
    assert "d" not in watch.quarantined
    again = decide_stragglers(_spec(StragglerAction.REPORT), watch, _status(), world, taken)
    assert [e.message for e in _emitted(again, "BadCommand")] == ["release: d is not quarantined"]


def a_restarted_agent_releases_its_node() -> None:
    watch = _slow_b()
    watch.quarantined["c"] = 1.0
    decide_stragglers(_spec(StragglerAction.REPORT), watch, _status(), _world("a", "b", "c"), [])
    assert "c" in watch.quarantined  # the same registration: still quarantined
    restarted = _world("a", "b", "c", started=2.0)
    actions = decide_stragglers(_spec(StragglerAction.REPORT), watch, _status(), restarted, [])
    assert [e.message for e in _emitted(actions, "NodeReleased")] == [
        "c's agent started again: it may be a spare again"
    ]


def a_quarantine_from_an_earlier_leader_holds_until_the_agent_restarts() -> None:
    watch = _slow_b()
    watch.quarantined["c"] = None  # read back from the job's status by a new leader
    decide_stragglers(_spec(StragglerAction.REPORT), watch, _status(), _world("a", "b", "c"), [])
    assert watch.quarantined == {"c": 1.0}


SCENARIOS: list[Callable[[], None]] = [
    a_straggler_is_swapped_for_a_warm_spare_and_quarantined,
    a_swap_waits_until_the_straggler_has_cost_the_job_confirm,
    without_a_spare_the_straggler_keeps_its_slot_said_once,
    with_sites_of_one_size_a_straggler_takes_a_spare_of_its_own_site_only,
    a_swap_that_does_not_pay_is_not_made,
    report_only_never_swaps,
    nothing_is_decided_while_the_policy_changes_the_group,
    an_operator_releases_a_quarantined_node,
    a_restarted_agent_releases_its_node,
    a_quarantine_from_an_earlier_leader_holds_until_the_agent_restarts,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_straggler_swaps(scenario: Callable[[], None]) -> None:
    scenario()
