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
        outer: the leaders' gloo group (None on a rank that is not its site's leader).
        leader: this site's leader (global rank).
        device: where tensors sent on ``inner`` must be (the worker's GPU under
            NCCL, else the CPU).
    """

    sites: Sites
    index: int
    inner: dist.ProcessGroup
    inner_host: dist.ProcessGroup
    outer: dist.ProcessGroup | None
    leader: int
    device: torch.device

    @property
    def is_leader(self) -> bool:
        return self.outer is not None


def form_site_groups(
    sites: Sites, rank: int, device: torch.device, timeout: timedelta
) -> SiteGroups:
    """Create the groups of ``sites`` (every rank of the generation calls this).

    Args:
        device: this worker's device (its GPU is where NCCL's tensors go).
        timeout: what a collective of these groups may take until the generation's
            guard learns better (the generation's own groups'; torch's default for a
            new group is 30 minutes).
    """
    index = sites.index_of(rank)
    gloo_data = dist.get_backend() == "gloo"
    inner = _each_site(sites, index, None, timeout)
    inner_host = inner if gloo_data else _each_site(sites, index, "gloo", timeout)
    outer = dist.new_group(ranks=list(sites.leaders), backend="gloo", timeout=timeout)
    leader = sites.leaders[index]
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
