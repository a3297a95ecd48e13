"""Sites of one size for a model sharded in each site (pure; runs in the controller).

Under a delayed sync with an FSDP2 model in each site, rank ``i`` of every site
holds slice ``i`` of the model, so every site must have as many ranks.  A site
that lost a node with no spare of its own to take the slot leaves the sites
uneven; rather than fail the job, the controller leaves nodes out, as torchft
leaves out a replica group that lost a member: each site kept takes its first
nodes (in the generation's order) up to one size, and a site that cannot make
that size waits whole, its nodes warm spares.  The size is the one that keeps
the most ranks training, the larger on a tie (fewer, whole sites: a site whose
size is kept keeps its own state, see ``agents/recovery/site_plan.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.controller.plans import node_info
from orchestrator.controller.world import World
from orchestrator.spec.job import JobSpec
from orchestrator.topology import NodeInfo

__all__ = ["balance_sites", "balanced_order"]


def balanced_order(
    spec: JobSpec, world: World, order: Sequence[str]
) -> tuple[list[str], list[str]]:
    """:func:`balance_sites` of the nodes ``order`` names, by the job's ``sync.site_label``,
    keeping ``nodes.min`` nodes where a size does."""
    infos = [node_info(spec, world, n) for n in order]
    return balance_sites(infos, spec.sync.site_label, spec.nodes.min)


def balance_sites(
    order: Sequence[NodeInfo], site_label: str, min_nodes: int = 1
) -> tuple[list[str], list[str]]:
    """``order``'s nodes split into (members in ``order``'s order, nodes left out) so that
    every site (the nodes sharing ``site_label``) of the members has as many ranks.

    Sizes that keep at least ``min_nodes`` nodes come first (nodes may run different
    numbers of workers: the most ranks may be the fewest nodes).  Nothing is left out
    where the sites are of one size already.
    """
    if not order:
        return [], []
    sites: dict[str, list[NodeInfo]] = {}
    for node in order:
        sites.setdefault(node.site(site_label), []).append(node)
    reach: dict[str, list[int]] = {}  # the ranks of each site's first 1, 2, ... nodes
    for name, nodes in sites.items():
        total, sums = 0, []
        for node in nodes:
            total += node.slots
            sums.append(total)
        reach[name] = sums
    sizes = {size for sums in reach.values() for size in sums}

    def rank(size: int) -> tuple[bool, int, int]:
        nodes = sum(sums.index(size) + 1 for sums in reach.values() if size in sums)
        return nodes >= min_nodes, size * sum(size in s for s in reach.values()), size

    best = max(sizes, key=rank)
    kept: set[str] = set()
    for name, nodes in sites.items():
        if best in reach[name]:
            kept.update(n.node_id for n in nodes[: reach[name].index(best) + 1])
    members = [n.node_id for n in order if n.node_id in kept]
    return members, [n.node_id for n in order if n.node_id not in kept]
