"""The process groups of a generation's sites (runs in the training process).

Under a delayed sync each site trains as a data-parallel group of its own
(its DDP runs on the site's group, on the job's data backend: NCCL on GPU
workers), and the sites' leaders form one more group that carries the
pseudo-gradients between sites.  That group is gloo's whatever the data
backend: the outer state lives in host memory (see
:mod:`agents.sync.outer_sync`), and a link between sites is a TCP link.
Under NCCL each site also gets a gloo group of its own for what a state sync
sends on the host (the structure, host tensors) and for the per-step check
that the generation moved on.  Every rank creates every
group, in the same order, as torch requires; each keeps the ones it belongs
to.  They go with the generation's default group
(:func:`~agents.runtime.process_group.teardown_group` destroys them all).

With an FSDP2 model in each site (``per_slice``) the sites are equal-sized and
rank ``i`` of every site holds the same slice: the group between sites is then
one gloo group per slice index, made of the ``i``-th ranks of the sites, and
every rank carries its own slice's pseudo-gradient (no leader, no broadcast in
the site).
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
        outer: the leaders' gloo group (None on a rank that is not its site's leader);
            ``per_slice``: the gloo group of this rank's slice index across the sites.
        leader: this site's leader (global rank).
        device: where tensors sent on ``inner`` must be (the worker's GPU under
            NCCL, else the CPU).
        per_slice: each rank syncs its own slice with the same-index ranks of the
            other sites (an FSDP2 model in each site).
    """

    sites: Sites
    index: int
    inner: dist.ProcessGroup
    inner_host: dist.ProcessGroup
    outer: dist.ProcessGroup | None
    leader: int
    device: torch.device
    per_slice: bool = False

    @property
    def is_leader(self) -> bool:
        return self.outer is not None


def form_site_groups(
    sites: Sites, rank: int, device: torch.device, timeout: timedelta, per_slice: bool = False
) -> SiteGroups:
    """Create the groups of ``sites`` (every rank of the generation calls this).

    Args:
        device: this worker's device (its GPU is where NCCL's tensors go).
        timeout: what a collective of these groups may take until the generation's
            guard learns better (the generation's own groups'; torch's default for a
            new group is 30 minutes).
        per_slice: one group between sites per slice index instead of the leaders'
            (the sites must be equal-sized: see :func:`agents.recovery.site_shards.check_sites`).
    """
    index = sites.index_of(rank)
    gloo_data = dist.get_backend() == "gloo"
    inner = _each_site(sites, index, None, timeout)
    inner_host = inner if gloo_data else _each_site(sites, index, "gloo", timeout)
    leader = sites.leaders[index]
    if per_slice:
        at = sites.ranks[index].index(rank)
        mine: dist.ProcessGroup | None = None
        for i in range(len(sites.ranks[index])):
            same = [ranks[i] for ranks in sites.ranks]
            group = dist.new_group(ranks=same, backend="gloo", timeout=timeout)
            mine = group if i == at else mine
        assert isinstance(mine, dist.ProcessGroup)
        return SiteGroups(
            sites,
            index,
            inner,
            inner_host,
            mine,
            leader,
            torch.device("cpu") if gloo_data else device,
            per_slice=True,
        )
    outer = dist.new_group(ranks=list(sites.leaders), backend="gloo", timeout=timeout)
    return SiteGroups(
        sites=sites,
        index=index,
        inner=inner,
        inner_host=inner_host,
        outer=outer if rank == leader and isinstance(outer, dist.ProcessGroup) else None,
        leader=leader,
        device=torch.device("cpu") if gloo_data else device,
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
