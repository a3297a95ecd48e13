"""Warm spares spread over racks when a job starts (the controller's pure policy).

On Kubernetes the operator spreads agent pods over racks; this is the other
half: the controller keeps one spare per rack before a second in any, so a
failed node usually finds a spare in its own rack.
"""

from __future__ import annotations

import pytest

from orchestrator.api import JobPhase
from orchestrator.controller.placement import spread_spares
from orchestrator.state.jobs import JobStatus
from orchestrator.topology import NodeInfo, topology_order
from tests.unit.test_controller_policy import RACKS, Run, _order, _spec, _world

pytestmark = pytest.mark.unit

LABELS = ("zone", "rack", "host")


def nodes(racks: dict[str, str]) -> list[NodeInfo]:
    infos = [NodeInfo(n, 1, {"zone": "z", "rack": r, "host": n}) for n, r in racks.items()]
    return list(topology_order(infos, LABELS).nodes)


def test_one_spare_per_rack_before_a_second_in_any() -> None:
    order = nodes({f"n{i}": f"r{i % 3}" for i in range(9)})  # 3 racks of 3
    spares = spread_spares(order, 3, LABELS)
    racks = {n.node_id: n.labels["rack"] for n in order}
    assert sorted(racks[s] for s in spares) == ["r0", "r1", "r2"]
    more = spread_spares(order, 5, LABELS)
    counts = sorted(sum(1 for s in more if racks[s] == r) for r in ("r0", "r1", "r2"))
    assert counts == [1, 2, 2]


def test_spares_are_the_last_of_each_rack_so_active_nodes_stay_together() -> None:
    order = nodes({"a": "r1", "b": "r1", "c": "r2", "d": "r2"})
    assert sorted(spread_spares(order, 2, LABELS)) == ["b", "d"]


def test_without_rack_labels_the_spares_are_the_tail_of_the_order() -> None:
    infos = [NodeInfo(n, 1, {"host": n}) for n in "abcd"]
    order = list(topology_order(infos, LABELS).nodes)
    assert spread_spares(order, 2, LABELS) == ["d", "c"]
    assert spread_spares(order, 0, LABELS) == []
    assert sorted(spread_spares(order, 9, LABELS)) == ["a", "b", "c", "d"]


def test_a_job_starts_with_its_spares_in_two_racks() -> None:
    run = Run(_spec(min_nodes=2, max_nodes=2, spares=2), status=JobStatus("job"))
    run.tick(_world(["a", "b", "c", "d"]))  # racks: a, c in r1; b, d in r2
    (plan,) = run.plans()
    assert sorted(RACKS[s] for s in plan.spares) == ["r1", "r2"]
    assert sorted(_order(plan) + plan.spares) == ["a", "b", "c", "d"]
    assert run.status.phase is JobPhase.RUNNING
