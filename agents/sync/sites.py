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

__all__ = ["Sites"]


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
