"""The process groups of a generation's sites (runs in the training process).

Under a delayed sync each site trains as a data-parallel group of its own
(its DDP runs on the site's group), and the sites' leaders form one more
group that carries the pseudo-gradients between sites.  Every rank creates
every group, in the same order, as torch requires; each keeps the ones it
belongs to.  They go with the generation's default group
(:func:`~agents.runtime.process_group.teardown_group` destroys them all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from agents.sync.sites import Sites

__all__ = ["SiteGroups", "form_site_groups"]


@dataclass(frozen=True)
class SiteGroups:
    """One rank's view of its generation's sites.

    Attributes:
        sites: every site's ranks.
        index: this rank's site.
        inner: this site's group (its DDP, its state sync, the outer result's broadcast).
        outer: the leaders' group (None on a rank that is not its site's leader).
        leader: this site's leader (global rank).
    """

    sites: Sites
    index: int
    inner: dist.ProcessGroup
    outer: dist.ProcessGroup | None
    leader: int

    @property
    def is_leader(self) -> bool:
        return self.outer is not None


def form_site_groups(sites: Sites, rank: int) -> SiteGroups:
    """Create the groups of ``sites`` (every rank of the generation calls this)."""
    index = sites.index_of(rank)
    inner: dist.ProcessGroup | None = None
    for i, ranks in enumerate(sites.ranks):
        group = dist.new_group(ranks=list(ranks))
        if i == index:
            inner = group
    outer = dist.new_group(ranks=list(sites.leaders))
    assert isinstance(inner, dist.ProcessGroup)
    leader = sites.leaders[index]
    return SiteGroups(
        sites=sites,
        index=index,
        inner=inner,
        outer=outer if rank == leader and isinstance(outer, dist.ProcessGroup) else None,
        leader=leader,
    )
