"""Topology-aware rank order: contiguous groups, minimal crossings, stable replacement."""

from __future__ import annotations

import random

import pytest

from orchestrator.topology import (
    NodeInfo,
    TopologyError,
    TopologyOrder,
    interleaved_order,
    min_ring_crossings,
    ring_crossings,
    topology_order,
)

pytestmark = pytest.mark.unit


def _node(node_id: str, zone: str, rack: str, host: str, slots: int = 2) -> NodeInfo:
    return NodeInfo(node_id, slots, {"zone": zone, "rack": rack, "host": host})


def _cluster() -> list[NodeInfo]:
    """Two zones, three racks, two nodes on one host."""
    return [
        _node("n0", "z1", "r1", "h0"),
        _node("n1", "z1", "r2", "h1"),
        _node("n2", "z2", "r3", "h2"),
        _node("n3", "z1", "r1", "h3"),
        _node("n4", "z2", "r3", "h4"),
        _node("n5", "z1", "r2", "h1"),
        _node("n6", "z1", "r1", "h0"),
        _node("n7", "z2", "r3", "h2"),
    ]


def _contiguous(values: list[str]) -> bool:
    """Each value occupies one run (treating the list as a line, not a ring)."""
    seen: set[str] = set()
    for i, v in enumerate(values):
        if v in seen and values[i - 1] != v:
            return False
        seen.add(v)
    return True


def test_every_host_rack_and_zone_is_contiguous_and_crossed_minimally() -> None:
    nodes = _cluster()
    random.Random(3).shuffle(nodes)
    order = topology_order(nodes)
    assert order.world_size == 16
    for label in ("zone", "rack", "host"):
        values = order.label_of_rank(label)
        assert _contiguous(values), (label, values)
        assert order.ring_crossings(label) == min_ring_crossings(values)
    # Ranks of a node are contiguous, local rank ascending.
    for node in order.nodes:
        ranks = order.ranks_of(node.node_id)
        assert ranks == list(range(ranks[0], ranks[0] + node.slots))
        assert [order.rank_of(node.node_id, i) for i in range(node.slots)] == ranks


def test_order_does_not_depend_on_input_order() -> None:
    nodes = _cluster()
    orders = set()
    for seed in range(5):
        random.Random(seed).shuffle(nodes)
        orders.add(topology_order(nodes).node_ids)
    assert len(orders) == 1


def test_interleaved_order_crosses_racks_on_every_edge() -> None:
    nodes = [_node(f"n{i}", "z", f"r{i % 2}", f"h{i}", slots=1) for i in range(4)]
    order = topology_order(nodes)
    assert order.ring_crossings("rack") == 2
    worst = interleaved_order(order)
    assert worst.ring_crossings("rack") == 4
    assert sorted(worst.node_ids) == sorted(order.node_ids)


def test_replacement_takes_failed_nodes_place() -> None:
    before = topology_order(_cluster())
    failed = before.nodes[2]
    survivors = [n for n in before.nodes if n.node_id != failed.node_id]
    spare = NodeInfo("spare", failed.slots, dict(failed.labels))
    after = topology_order([*reversed(survivors), spare], previous=before)
    expected = [("spare" if i == failed.node_id else i) for i in before.node_ids]
    assert list(after.node_ids) == expected
    assert after.rank_of("spare", 0) == before.rank_of(failed.node_id, 0)


def test_replacement_from_another_rack_joins_its_own_rack() -> None:
    before = topology_order(_cluster())
    failed = next(n for n in before.nodes if n.labels["rack"] == "r1")
    survivors = [n for n in before.nodes if n.node_id != failed.node_id]
    spare = _node("spare", "z2", "r3", "h9")
    after = topology_order([spare, *survivors], previous=before)
    assert _contiguous(after.label_of_rank("rack"))
    assert _contiguous(after.label_of_rank("zone"))
    # Survivors keep their relative order.
    kept = [i for i in after.node_ids if i != "spare"]
    assert kept == [i for i in before.node_ids if i != failed.node_id]


def test_node_loss_without_replacement_closes_the_gap() -> None:
    before = topology_order(_cluster())
    gone = before.node_ids[0]
    after = topology_order([n for n in before.nodes if n.node_id != gone], previous=before)
    assert list(after.node_ids) == list(before.node_ids[1:])


def test_previous_as_id_list_keeps_survivor_order() -> None:
    nodes = [_node(f"n{i}", "z", "r", f"h{i}", slots=1) for i in range(4)]
    previous = ["n3", "n1", "n0", "n2"]
    order = topology_order(nodes, previous=previous)
    assert list(order.node_ids) == previous


def test_missing_labels_and_custom_label_names() -> None:
    nodes = [
        NodeInfo("a", 1, {"pod": "p2"}),
        NodeInfo("b", 1, {}),
        NodeInfo("c", 1, {"pod": "p1"}),
        NodeInfo("d", 1, {"pod": "p2"}),
    ]
    order = topology_order(nodes, label_names=["pod"])
    assert order.label_of_rank("pod") == ["", "p1", "p2", "p2"]
    assert isinstance(order, TopologyOrder)


def test_ring_crossings_counts_wraparound() -> None:
    assert ring_crossings(["a", "a", "b", "b"]) == 2
    assert ring_crossings(["a", "b", "a", "b"]) == 4
    assert ring_crossings(["a"]) == 0


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ([NodeInfo("x"), NodeInfo("x")], "appears twice"),
        ([NodeInfo("x", slots=0)], "at least 1"),
    ],
)
def test_bad_node_lists_are_rejected(nodes: list[NodeInfo], message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        topology_order(nodes)
