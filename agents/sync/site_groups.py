"""The process groups of a generation's sites (runs in the training process).

Under a delayed sync each site trains as a data-parallel group of its own
(its DDP runs on the site's group, on the job's data backend: NCCL on GPU
workers).  No group spans the sites: the pseudo-gradients travel between
them in rounds through the generation's store
(:mod:`agents.sync.round_exchange`), carried by each site's leader, so a
site that is late holds no collective of the others.  Under NCCL each site
also gets a gloo group of its own for what a state sync sends on the host
(the structure, host tensors) and for the per-step check that the
generation moved on.  Every rank creates every group, in the same order, as
torch requires; each keeps the ones it belongs to.  They go with the generation's default group
(:func:`~agents.runtime.process_group.teardown_group` destroys them all).

With an FSDP2 model in each site (``per_slice``) the sites are equal-sized and
rank ``i`` of every site holds the same slice: every rank carries its own
slice's pseudo-gradient to the rounds, with the ``i``-th ranks of the other
sites (no leader, no broadcast in the site).  Those ranks form a gloo group
per slice index, for what a join settles between the sites' slices
(:mod:`agents.recovery.site_shards`); no step uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from agents.sync.sites import Sites

__all__ = ["SiteGroups", "form_site_groups"]


@dataclass(frozen=True)
class SiteGroups:
    """One rank's view of its generation's sites.

    Attributes:
        sites: every site's ranks.
        index: this rank's site.
        inner: this site's group on the data backend (its DDP, the device tensors
            of its state sync, the outer result's broadcast).
        inner_host: this site's gloo group (the structure and host tensors of its
            state sync, the per-step generation check); ``inner`` itself when the
            data backend is gloo.
        leader: this site's leader (global rank): it carries the site's
            pseudo-gradients to the rounds (each rank its own, ``per_slice``).
        rank: this rank (global).
        outer: ``per_slice``: the gloo group of this rank's slice index across the
            sites (a join's); None otherwise.
        device: where tensors sent on ``inner`` must be (the worker's GPU under
            NCCL, else the CPU).
        per_slice: each rank syncs its own slice with the same-index ranks of the
            other sites (an FSDP2 model in each site).
    """

    sites: Sites
    index: int
    inner: dist.ProcessGroup
    inner_host: dist.ProcessGroup
    leader: int
    rank: int
    device: torch.device
    per_slice: bool = False
    outer: dist.ProcessGroup | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def form_site_groups(
    sites: Sites, rank: int, device: torch.device, timeout: timedelta, per_slice: bool = False
) -> SiteGroups:
    """Create the groups of ``sites`` (every rank of the generation calls this).

    Args:
        device: this worker's device (its GPU is where NCCL's tensors go).
        timeout: what a collective of these groups may take until the generation's
            guard learns better (the generation's own groups'; torch's default for a
            new group is 30 minutes).
        per_slice: every rank carries its own slice (the sites must be equal-sized:
            see :func:`agents.recovery.site_shards.check_sites`).
    """
    index = sites.index_of(rank)
    gloo_data = dist.get_backend() == "gloo"
    inner = _each_site(sites, index, None, timeout)
    inner_host = inner if gloo_data else _each_site(sites, index, "gloo", timeout)
    mine: dist.ProcessGroup | None = None
    if per_slice:
        at = sites.ranks[index].index(rank)
        for i in range(len(sites.ranks[index])):
            same = [ranks[i] for ranks in sites.ranks]
            group = dist.new_group(ranks=same, backend="gloo", timeout=timeout)
            mine = group if i == at and isinstance(group, dist.ProcessGroup) else mine
    return SiteGroups(
        sites=sites,
        index=index,
        inner=inner,
        inner_host=inner_host,
        leader=sites.leaders[index],
        rank=rank,
        device=torch.device("cpu") if gloo_data else device,
        per_slice=per_slice,
        outer=mine,
    )


def _each_site(
    sites: Sites, index: int, backend: str | None, timeout: timedelta
) -> dist.ProcessGroup:
    """One group per site on ``backend`` (None: the default group's); this site's."""
    mine: dist.ProcessGroup | None = None
    for i, ranks in enumerate(sites.ranks):
        group = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
        if i == index:
            mine = group
    assert isinstance(mine, dist.ProcessGroup)
    return mine
