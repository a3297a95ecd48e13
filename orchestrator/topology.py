"""Topology-aware rank order: which global rank each (node, local rank) gets.

A ring all-reduce sends every byte across every edge of the ring, so its
speed is set by the slowest edge it uses and by how many times it uses it.
Nodes register topology labels (by default ``zone``, ``rack`` and ``host``,
coarse to fine); this module orders ranks so that ring neighbours share a
host first, then a rack, then a zone.  Every group at every level gets a
contiguous run of ranks, so the ring crosses each boundary the minimum
number of times: once in and once out of each group.

The order is recomputed when membership changes.  Given the previous order,
survivors keep their relative places and a newcomer takes the place of a
departed node of the same group (a hot-swapped replacement lands where the
failed node was), so most ranks keep their neighbours and their state.

Everything here is pure: dataclasses in, dataclasses out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: Labels used when the job spec does not say otherwise (coarse to fine).
DEFAULT_LABELS: tuple[str, ...] = ("zone", "rack", "host")


class TopologyError(ValueError):
    """The node list cannot be ordered (duplicate ids, no slots...)."""


@dataclass(frozen=True)
class NodeInfo:
    """One node as the controller sees it.

    Attributes:
        node_id: unique, stable id of the node (agent registration id).
        slots: number of worker processes (local ranks) on the node.
        labels: topology labels such as ``{"zone": "a", "rack": "r1", "host": "h3"}``;
            a missing label counts as the empty string.
    """

    node_id: str
    slots: int = 1
    labels: Mapping[str, str] = field(default_factory=dict)

    def path(self, label_names: Sequence[str]) -> tuple[str, ...]:
        """The node's label values, coarse to fine, for ``label_names``."""
        return tuple(str(self.labels.get(name, "")) for name in label_names)

    def site(self, site_label: str) -> str:
        """The site of the node under a delayed sync (:func:`site_of`)."""
        return site_of(self.node_id, self.labels, site_label)


def site_of(node_id: str, labels: Mapping[str, str], site_label: str) -> str:
    """The site a node belongs to under a delayed sync: its ``site_label`` value, or, for a
    node without it, a site of its own (``node:<id>``).  The workers and the controller
    both place nodes by this rule."""
    return str(labels.get(site_label) or f"node:{node_id}")


@dataclass(frozen=True)
class RankSlot:
    """Where one global rank lives.

    Attributes:
        rank: global rank.
        node_id: node running this rank.
        local_rank: index of the process on its node.
        node_rank: index of the node in the order (torchrun's ``GROUP_RANK``).
    """

    rank: int
    node_id: str
    local_rank: int
    node_rank: int


@dataclass(frozen=True)
class TopologyOrder:
    """Nodes in ring order and the ranks they get.

    Attributes:
        nodes: the nodes in order; node ``i`` has node rank ``i``.
        label_names: the labels the order was computed from, coarse to fine.
    """

    nodes: tuple[NodeInfo, ...]
    label_names: tuple[str, ...] = DEFAULT_LABELS

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(n.node_id for n in self.nodes)

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.nodes)

    @property
    def slots(self) -> tuple[RankSlot, ...]:
        """Every rank in order: ranks of a node are contiguous, local rank ascending."""
        out: list[RankSlot] = []
        for node_rank, node in enumerate(self.nodes):
            for local in range(node.slots):
                out.append(RankSlot(len(out), node.node_id, local, node_rank))
        return tuple(out)

    def ranks_of(self, node_id: str) -> list[int]:
        """Global ranks of one node."""
        return [s.rank for s in self.slots if s.node_id == node_id]

    def rank_of(self, node_id: str, local_rank: int) -> int:
        """Global rank of ``local_rank`` on ``node_id``.

        Raises:
            KeyError: the node is not in the order or has no such local rank.
        """
        for s in self.slots:
            if s.node_id == node_id and s.local_rank == local_rank:
                return s.rank
        raise KeyError(f"no rank for node {node_id!r} local rank {local_rank}")

    def label_of_rank(self, label: str) -> list[str]:
        """The value of ``label`` for every rank, in rank order."""
        return [str(n.labels.get(label, "")) for n in self.nodes for _ in range(n.slots)]

    def ring_crossings(self, label: str) -> int:
        """How many ring edges join ranks with different values of ``label``."""
        return ring_crossings(self.label_of_rank(label))


def ring_crossings(values: Sequence[str]) -> int:
    """Edges of the ring ``values[0] → values[1] → … → values[0]`` whose ends differ."""
    n = len(values)
    if n < 2:
        return 0
    return sum(1 for i in range(n) if values[i] != values[(i + 1) % n])


def min_ring_crossings(values: Iterable[str]) -> int:
    """The fewest boundary crossings any ring over these values can have."""
    distinct = len(set(values))
    return 0 if distinct < 2 else distinct


def topology_order(
    nodes: Iterable[NodeInfo],
    label_names: Sequence[str] = DEFAULT_LABELS,
    previous: TopologyOrder | Sequence[str] | None = None,
) -> TopologyOrder:
    """Order nodes so that every label group is contiguous in the ring.

    Without ``previous``, groups and nodes are sorted by label value then
    node id, so every rank computes the same order from the same members.
    With ``previous`` (an earlier order, or its node ids), the order is kept
    stable: groups keep their previous relative order, surviving nodes keep
    their relative places, and a new node takes the place of a departed node
    from its own innermost group (first vacancy first).  New nodes that find
    no vacancy go to the end of their group; new groups go after the known
    ones, sorted.

    Args:
        nodes: the current members.
        label_names: topology labels, coarse to fine (``CommSpec.topology_labels``).
        previous: the order before the membership change, if any.

    Returns:
        The new order.

    Raises:
        TopologyError: duplicate node ids or a node with fewer than one slot.
    """
    members = list(nodes)
    names = tuple(label_names)
    seen: set[str] = set()
    for node in members:
        if node.node_id in seen:
            raise TopologyError(f"node id {node.node_id!r} appears twice")
        if node.slots < 1:
            raise TopologyError(f"node {node.node_id!r} has {node.slots} slots; need at least 1")
        seen.add(node.node_id)

    if isinstance(previous, TopologyOrder):
        prev_ids: list[str] = list(previous.node_ids)
        prev_paths = {n.node_id: n.path(names) for n in previous.nodes}
    else:
        prev_ids = list(previous or ())
        prev_paths = {}
    current = {n.node_id: n for n in members}
    for node_id in prev_ids:
        if node_id in current:
            prev_paths[node_id] = current[node_id].path(names)

    # Rank each group prefix by first appearance in the previous order.
    known_prefix: dict[tuple[str, ...], int] = {}
    for node_id in prev_ids:
        path = prev_paths.get(node_id)
        if path is None:
            continue
        for depth in range(1, len(path) + 1):
            known_prefix.setdefault(path[:depth], len(known_prefix))

    def group_key(path: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
        return tuple(
            (known_prefix.get(path[: d + 1], len(known_prefix)), path[d]) for d in range(len(path))
        )

    groups: dict[tuple[str, ...], list[NodeInfo]] = {}
    for node in members:
        groups.setdefault(node.path(names), []).append(node)

    previously = _Previous(prev_ids, prev_paths)
    ordered: list[NodeInfo] = []
    for path in sorted(groups, key=group_key):
        ordered.extend(_order_within_group(groups[path], path, previously))
    return TopologyOrder(tuple(ordered), names)


class _Previous:
    """The previous order, indexed once (a thousand single-node groups each looked
    through the whole previous order: a million steps per new plan)."""

    def __init__(self, ids: list[str], paths: Mapping[str, tuple[str, ...]]) -> None:
        self.ids = ids
        self.paths = paths
        self.known = set(ids)
        #: positions in ``ids``: of the ids in each previous group, and of each id
        self.in_group: dict[tuple[str, ...], list[int]] = {}
        self.of_id: dict[str, list[int]] = {}
        for k, node_id in enumerate(ids):
            self.of_id.setdefault(node_id, []).append(k)
            if (path := paths.get(node_id)) is not None:
                self.in_group.setdefault(path, []).append(k)


def _order_within_group(
    members: list[NodeInfo], path: tuple[str, ...], previously: _Previous
) -> list[NodeInfo]:
    """Nodes of one innermost group: survivors in place, newcomers into vacancies."""
    by_id = {n.node_id: n for n in members}
    prev_paths = previously.paths
    # The group's previous sequence: ids that were in this group before, and its
    # members now, in their previous order.
    at = set(previously.in_group.get(path, ()))
    for node_id in by_id:
        at.update(previously.of_id.get(node_id, ()))
    before = [previously.ids[k] for k in sorted(at)]
    newcomers = sorted(i for i in by_id if i not in previously.known)
    out: list[str] = []
    for node_id in before:
        if node_id in by_id:
            out.append(node_id)
        elif newcomers and prev_paths.get(node_id, path) == path:
            out.append(newcomers.pop(0))
    out.extend(newcomers)
    return [by_id[i] for i in out]


def interleaved_order(order: TopologyOrder) -> TopologyOrder:
    """The worst case for comparison: nodes dealt round-robin across the top-level groups.

    Used by benchmarks to show what a topology-blind order costs.
    """
    if not order.label_names:
        return order
    buckets: dict[str, list[NodeInfo]] = {}
    for node in order.nodes:
        buckets.setdefault(node.path(order.label_names)[0], []).append(node)
    lists = list(buckets.values())
    if len(lists) == 1:
        depth = 1
        while depth < len(order.label_names) and len(lists) == 1:
            buckets = {}
            for node in order.nodes:
                buckets.setdefault(node.path(order.label_names)[depth], []).append(node)
            lists = list(buckets.values())
            depth += 1
    out: list[NodeInfo] = []
    for i in range(max(len(lst) for lst in lists)):
        out.extend(lst[i] for lst in lists if i < len(lst))
    return TopologyOrder(tuple(out), order.label_names)
