"""Where a replacement goes: the nearest warm spare, and a ring order that stays short.

Pure functions over :class:`~orchestrator.topology.NodeInfo`, used by the
controller's policy when it replaces failed members:

* :func:`spread_spares`: which nodes wait as warm spares when a job starts:
  one per rack (then zone) before a second in any, so a failed node usually
  finds a spare in its own rack and one lost rack does not take every spare;
* :func:`spares_by_site`: the same under a delayed sync (DiLoCo): spares come
  from the sites with the most nodes, so that every site keeps members;
* :func:`nearest_spare`: the spare that shares the most topology labels with
  the failed node, coarse to fine (its rack, then its zone), ties going to the
  first in topology order;
* :func:`replacement_order`: the new members in ring order.  Each spare first
  takes its failed node's slot, so every survivor keeps its rank; when that
  makes the ring cross more zone or rack boundaries than a topology order of
  the same nodes would, the topology order wins (every DDP rank holds the
  same state, so ranks may move).
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.topology import NodeInfo, TopologyOrder, topology_order


def spread_spares(order: Sequence[NodeInfo], count: int, labels: Sequence[str]) -> list[str]:
    """``count`` node ids of ``order`` (a topology order) to keep as spares, spread over racks.

    Nodes are grouped by every label but the finest (the host): by zone and
    rack.  Each round takes the last node of each group, the groups from the
    end of the order back, so no rack holds a second spare while another has
    none, and the nodes that train stay contiguous within their racks.  One
    spare, or no rack and zone labels, gives what the order's tail would: the
    spares are its last nodes.
    """
    groups: dict[tuple[str, ...], list[NodeInfo]] = {}
    for node in order:
        groups.setdefault(node.path(list(labels[:-1])), []).append(node)
    taken: list[str] = []
    while len(taken) < count and any(groups.values()):
        for nodes in reversed(list(groups.values())):
            if nodes and len(taken) < count:
                taken.append(nodes.pop().node_id)
    return taken


def spares_by_site(order: Sequence[NodeInfo], count: int, site_label: str) -> list[str]:
    """``count`` node ids of ``order`` (a topology order) to keep as spares, each from the
    site (the nodes sharing ``site_label``) with the most nodes left, the later site on a
    tie, its last node: every site keeps members while it can."""
    sites: dict[str, list[NodeInfo]] = {}
    for node in order:
        sites.setdefault(str(node.labels.get(site_label, "")), []).append(node)
    taken: list[str] = []
    groups = list(sites.values())
    while len(taken) < count and any(groups):
        largest = max(range(len(groups)), key=lambda i: (len(groups[i]), i))
        taken.append(groups[largest].pop().node_id)
    return taken


def nearest_spare(failed: NodeInfo, spares: Sequence[NodeInfo], labels: Sequence[str]) -> NodeInfo:
    """The spare closest to ``failed`` in the topology (``spares`` must not be empty)."""
    path = failed.path(labels)

    def shared(spare: NodeInfo) -> int:
        mine, depth = spare.path(labels), 0
        while depth < len(path) and path[depth] == mine[depth]:
            depth += 1
        return depth

    best = max(shared(s) for s in spares)
    return next(s for s in spares if shared(s) == best)


def crossings(order: Sequence[NodeInfo], labels: Sequence[str]) -> tuple[int, ...]:
    """Boundary crossings of the ring over ``order``, per label, coarse first."""
    ring = TopologyOrder(tuple(order), tuple(labels))
    return tuple(ring.ring_crossings(label) for label in labels)


def replacement_order(
    members: Sequence[NodeInfo],
    swaps: dict[str, NodeInfo],
    labels: Sequence[str],
) -> list[str]:
    """Node ids of the next generation in ring order.

    Args:
        members: the current generation's nodes, in rank order.
        swaps: failed node id → the spare that replaces it; a failed node
            without a spare must be absent from ``members`` already.
        labels: topology labels, coarse to fine.
    """
    in_slots = [swaps.get(m.node_id, m) for m in members]
    sorted_ring = topology_order(in_slots, labels, previous=[m.node_id for m in members]).nodes
    # hosts differ between any two nodes: only the coarser labels can favour an order
    coarse = list(labels[:-1]) if len(labels) > 1 else list(labels)
    if crossings(in_slots, coarse) <= crossings(sorted_ring, coarse):
        return [n.node_id for n in in_slots]
    return [n.node_id for n in sorted_ring]
