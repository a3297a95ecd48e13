"""Which ranks form each site (pure; runs in the training process).

A site is the nodes of a generation that share the value of the job's
``sync.site_label`` (``zone`` by default); a node without the label is a
site of its own, named by the node.  Sites are numbered in the order of
their first rank (ranks follow topology order), and a site's first rank is
its *leader*: the leaders carry the sites' pseudo-gradients between sites.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.state.records import Plan
from orchestrator.topology import site_of

__all__ = ["Sites", "site_unchanged"]


@dataclass(frozen=True)
class Sites:
    """The sites of one generation.

    Attributes:
        names: each site's label value, in site order.
        ranks: each site's global ranks, ascending, in site order.
    """

    names: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def of_plan(cls, plan: Plan, label: str) -> Sites:
        """The sites of ``plan``'s members by ``label``."""
        order: list[str] = []
        ranks: dict[str, list[int]] = {}
        for m in plan.members:
            name = site_of(m.node, m.labels, label)
            if name not in ranks:
                order.append(name)
                ranks[name] = []
            ranks[name].extend(range(m.rank_base, m.rank_base + m.nproc))
        return cls(tuple(order), tuple(tuple(sorted(ranks[n])) for n in order))

    def __len__(self) -> int:
        return len(self.names)

    @property
    def leaders(self) -> tuple[int, ...]:
        """The first rank of each site."""
        return tuple(r[0] for r in self.ranks)

    def index_of(self, rank: int) -> int:
        """The site ``rank`` belongs to.

        Raises:
            ValueError: ``rank`` is in no site.
        """
        for i, ranks in enumerate(self.ranks):
            if rank in ranks:
                return i
        raise ValueError(f"rank {rank} is in none of the sites {self.names}")


def site_unchanged(old: Plan, new: Plan, label: str, node: str) -> bool:
    """``node``'s site is the same in ``new`` as in ``old``: the same members with the same
    ranks, at the same place among the sites, in a world of the same size (so its ranks
    read the same shares of each global batch).  Such a site need not leave ``old`` at
    once for ``new``: it may train on to its next outer sync (see
    :meth:`agents.runtime.participants.DelayedSync.trains_through`)."""
    before = _site_in(old, label, node)
    return (
        old.world_size == new.world_size
        and before is not None
        and before == _site_in(new, label, node)
    )


def _site_in(
    plan: Plan, label: str, node: str
) -> tuple[str, int, list[tuple[str, int, int]]] | None:
    """``node``'s site in ``plan``: its name, its place among the sites, its members."""
    me = plan.member(node)
    if me is None:
        return None
    name = site_of(me.node, me.labels, label)
    members = [
        (m.node, m.rank_base, m.nproc)
        for m in plan.members
        if site_of(m.node, m.labels, label) == name
    ]
    return name, Sites.of_plan(plan, label).names.index(name), members
