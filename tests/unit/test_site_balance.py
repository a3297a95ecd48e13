"""Sites of one size for a model sharded in each site: which nodes the controller leaves out.

The pure rule (:func:`orchestrator.controller.site_balance.balance_sites`) and the
policy around it: a worker's report that the sites differ in size leads to a plan
whose sites are of one size (the nodes left out wait as warm spares, nobody is
declared failed), and every replacement after it keeps them so.
"""

from __future__ import annotations

import pytest

from orchestrator.api import JobPhase
from orchestrator.controller.actions import DeclareFailed, Emit
from orchestrator.controller.site_balance import balance_sites
from orchestrator.controller.world import World
from orchestrator.state import keys
from orchestrator.state.records import BreakReport, Member, NodeRecord, Plan
from orchestrator.topology import NodeInfo
from tests.unit.test_controller_policy import NOW, Run, _beat, _order, _spec, _world

pytestmark = pytest.mark.unit

ZONES = {"a1": "a", "a2": "a", "a3": "a", "b1": "b", "b2": "b"}


def _nodes(*names: str, slots: dict[str, int] | None = None) -> list[NodeInfo]:
    return [
        NodeInfo(n, (slots or {}).get(n, 1), {"zone": ZONES[n]} if n in ZONES else {})
        for n in names
    ]


@pytest.mark.parametrize(
    ("order", "kept", "left_out"),
    [
        (["a1", "a2", "b1"], ["a1", "a2"], ["b1"]),  # 2 ranks in one site beat 1 + 1
        (["a1", "b1", "a2", "b2", "a3"], ["a1", "b1", "a2", "b2"], ["a3"]),  # 2 + 2 beat 3
        (["a1", "b1", "a2", "b2"], ["a1", "b1", "a2", "b2"], []),  # of one size already
        (["a1", "x", "a2"], ["a1", "a2"], ["x"]),  # a node without the label: a site alone
        ([], [], []),
    ],
)
def test_the_size_that_keeps_the_most_ranks_wins_the_larger_on_a_tie(
    order: list[str], kept: list[str], left_out: list[str]
) -> None:
    got = balance_sites(_nodes(*order), "zone")
    assert got == (kept, left_out)


def test_a_size_that_keeps_nodes_min_nodes_comes_first() -> None:
    # a and b run 4 workers on one node, c and d 1 on each of two: size 4 keeps the most
    # ranks (8) on 2 nodes, size 2 keeps 4 ranks on 4 nodes
    ZONES.update({"c1": "c", "c2": "c", "d1": "d", "d2": "d"})
    nodes = _nodes("a1", "b1", "c1", "c2", "d1", "d2", slots={"a1": 4, "b1": 4})
    assert balance_sites(nodes, "zone", 2) == (["a1", "b1"], ["c1", "c2", "d1", "d2"])
    assert balance_sites(nodes, "zone", 3) == (["c1", "c2", "d1", "d2"], ["a1", "b1"])


def test_ranks_count_not_nodes() -> None:
    # a1 runs 2 workers, b1 and b2 one each: both sites have 2 ranks
    assert balance_sites(_nodes("a1", "b1", "b2", slots={"a1": 2}), "zone") == (
        ["a1", "b1", "b2"],
        [],
    )
    # a1 runs 2, b1 one: site b cannot make 2, and 1 + 1 is not possible for a
    assert balance_sites(_nodes("a1", "b1", slots={"a1": 2}), "zone") == (["a1"], ["b1"])


def _zoned(names: list[str], plan: Plan | None = None, **kw: object) -> World:
    world = _world([], plan, **kw)
    generation = plan.generation if plan else 0
    for name in names:
        world.nodes[name] = NodeRecord(
            host=name,
            address="127.0.0.1",
            slots=1,
            pid=1,
            worker_pids=[100],
            started=NOW - 100,
            labels={"zone": ZONES[name], "host": name},
        )
        world.progress[keys.worker_id(name, 0)] = _beat(generation)
    return world


def _plan(generation: int, *nodes: str) -> Plan:
    return Plan(generation, [Member(n, i, 1, {"zone": ZONES[n]}) for i, n in enumerate(nodes)])


def _uneven(step: int = 0) -> BreakReport:
    return BreakReport(
        step=step,
        reason="the sites must have as many ranks each",
        planned=False,
        at=NOW,
        unequal_sites=True,
    )


def test_a_report_of_uneven_sites_leaves_the_short_site_out_and_keeps_sites_even_after() -> None:
    run = Run(_spec(min_nodes=1, max_nodes=3, spares=0))
    first = _plan(1, "a1", "a2", "b1")
    run.tick(_zoned(["a1", "a2", "b1"], first, reports={"b1-0": _uneven()}))
    (even,) = run.plans()
    assert even.generation == 2 and _order(even) == ["a1", "a2"] and even.spares == ["b1"]
    assert [e.type for e in run.of(Emit)] == ["SitesBalanced"]
    assert run.of(DeclareFailed) == [] and run.status.failed_nodes == []
    assert run.memory.equal_sites and run.status.phase is JobPhase.RECOVERING
    # a2 dies later: b1 (zone b, a warm spare) takes its slot, and sites a and b have 1 each
    world = _zoned(
        ["a1", "a2", "b1"],
        even,
        reports={"a1-0": BreakReport(step=7, reason="peer gone", planned=False, at=NOW)},
        dead={"a2"},
    )
    run.tick(world)
    (swapped,) = run.plans()
    assert sorted(_order(swapped)) == ["a1", "b1"], swapped


def test_after_a_report_a_replacement_without_a_spare_keeps_the_sites_even() -> None:
    run = Run(_spec(min_nodes=1, max_nodes=4, spares=0))
    run.memory.equal_sites = True
    plan = _plan(3, "a1", "b1", "a2", "b2")
    report = BreakReport(step=9, reason="peer gone", planned=False, at=NOW)
    reports = {f"{n}-0": report for n in ("a1", "b1", "a2")}  # every survivor's
    run.tick(_zoned(["a1", "b1", "a2", "b2"], plan, reports=reports, dead={"b2"}))
    (new,) = run.plans()
    assert _order(new) == ["a1", "a2"] and "b1" in new.spares, new


def test_uneven_sites_that_no_size_fits_under_nodes_min_fail_the_job_with_the_reason() -> None:
    run = Run(_spec(min_nodes=3, max_nodes=3, spares=0))
    run.tick(_zoned(["a1", "a2", "b1"], _plan(1, "a1", "a2", "b1"), reports={"a1-0": _uneven()}))
    assert run.plans() == [] and run.status.phase is JobPhase.FAILED
    assert run.status.message == "the sites must have as many ranks each"


def test_a_member_gone_meanwhile_is_not_planned_again() -> None:
    run = Run(_spec(min_nodes=1, max_nodes=3, spares=0))
    world = _zoned(["a1", "a2", "b1"], _plan(1, "a1", "a2", "b1"), reports={"b1-0": _uneven()})
    world.dead = {"a2"}  # its agent refused a probe after the group formed
    run.tick(world)
    (even,) = run.plans()
    assert _order(even) == ["a1", "b1"] and run.status.phase is JobPhase.RECOVERING
