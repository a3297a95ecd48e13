"""Hierarchical all-reduce: reduce-scatter in the node, all-reduce across nodes, all-gather.

With ``L`` ranks per node and ``N`` nodes, a flat ring all-reduce pushes
``2·(W-1)/W`` of the gradient through every rank's link, including the slow
inter-node ones.  Here each node first reduce-scatters the bucket over its
fast local links, so local rank ``i`` holds the node's sum of shard ``i``; the
``i``-th ranks of all nodes then all-reduce that shard among themselves (each
inter-node link carries ``1/L`` of the bucket); finally each node all-gathers
the shards.  Buckets are zero-padded to a multiple of ``L``, so any bucket
size works.  The inter-node stage can be replaced by a compressed exchange
(dense inside the node, compressed across nodes).

:func:`build_groups` must be called by every rank in the same order, since
creating a process group is itself a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agents.comm import collectives
from agents.comm.api import CommConfigError, NodeLayout

#: Buckets at least this large are averaged in overlapping segments.
PIPELINE_MIN_NUMEL = 1 << 20
#: Number of segments of a pipelined bucket.
PIPELINE_SEGMENTS = 4

#: Averages one shard across nodes: (shard, shard index) -> node-mean of the shard.
InterStage = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class HierarchyGroups:
    """The process groups of one rank for a hierarchical exchange.

    Attributes:
        intra: the ranks of this rank's node (``None`` when one rank per node).
        inter: the same-local-rank peers on every node (``None`` with one node).
        local_rank: this rank's index in its node.
        local_world_size: ranks per node.
        num_nodes: nodes in the job.
    """

    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None
    local_rank: int
    local_world_size: int
    num_nodes: int


def build_groups(layout: NodeLayout, rank: int | None = None) -> HierarchyGroups:
    """Create the intra-node and inter-node groups for ``layout`` (collective call).

    Args:
        layout: node of every rank; every node must run the same number of ranks.
        rank: this rank (default: from the default process group).

    Raises:
        CommConfigError: the layout does not match the process group.
    """
    world = dist.get_world_size()
    if layout.world_size != world:
        raise CommConfigError(
            f"the node layout has {layout.world_size} ranks but the process group has {world}"
        )
    me = dist.get_rank() if rank is None else rank
    local_world = layout.local_world_size
    nodes = layout.nodes
    intra: dist.ProcessGroup | None = None
    inter: dist.ProcessGroup | None = None
    if local_world > 1:
        intra, _ = dist.new_subgroups_by_enumeration(nodes)
    if len(nodes) > 1:
        inter, _ = dist.new_subgroups_by_enumeration(layout.peers_by_local_rank())
    return HierarchyGroups(intra, inter, layout.local_rank_of(me), local_world, len(nodes))


def shard_length(numel: int, local_world_size: int) -> int:
    """Elements per shard for a bucket of ``numel`` (the bucket is padded to a multiple)."""
    return -(-numel // local_world_size)


def hierarchical_average(
    flat: torch.Tensor, groups: HierarchyGroups, inter_stage: InterStage | None = None
) -> torch.Tensor:
    """The mean of ``flat`` over all ranks, computed node-first.

    Args:
        flat: this rank's 1-D tensor (not modified).
        groups: from :func:`build_groups`.
        inter_stage: replaces the dense inter-node all-reduce; receives the
            node's sum of this rank's shard and returns the mean of that shard
            over nodes.

    Returns:
        A new tensor with the average over all ``local_world_size·num_nodes`` ranks.
    """
    n = flat.numel()
    local = groups.local_world_size
    if (
        inter_stage is None
        and groups.intra is not None
        and groups.inter is not None
        and n >= PIPELINE_MIN_NUMEL
    ):
        return _pipelined_average(flat, groups, PIPELINE_SEGMENTS)
    chunk = shard_length(n, local)
    if groups.intra is not None:
        padded = torch.zeros(chunk * local, dtype=flat.dtype)
        padded[:n] = flat
        shard = torch.empty(chunk, dtype=flat.dtype)
        collectives.reduce_scatter_single(shard, padded, group=groups.intra)
    else:
        shard = flat.clone()
    if inter_stage is not None and groups.inter is not None:
        shard = inter_stage(shard, groups.local_rank).mul_(groups.num_nodes)
    elif groups.inter is not None:
        dist.all_reduce(shard, group=groups.inter)
    if groups.intra is not None:
        gathered = torch.empty(chunk * local, dtype=flat.dtype)
        collectives.all_gather_single(gathered, shard, group=groups.intra)
        result = gathered[:n]
    else:
        result = shard
    return result.div_(local * groups.num_nodes)


def _pipelined_average(flat: torch.Tensor, groups: HierarchyGroups, segments: int) -> torch.Tensor:
    """Dense hierarchical average in segments, so one segment's inter-node
    all-reduce overlaps the next one's intra-node reduce-scatter."""
    assert groups.intra is not None and groups.inter is not None
    local = groups.local_world_size
    staged = []
    for seg in flat.tensor_split(segments):
        n = seg.numel()
        chunk = shard_length(n, local)
        padded = torch.zeros(chunk * local, dtype=flat.dtype)
        padded[:n] = seg
        shard = torch.empty(chunk, dtype=flat.dtype)
        work = collectives.reduce_scatter_single(shard, padded, group=groups.intra, async_op=True)
        staged.append((n, shard, work))
    reduced = []
    for n, shard, work in staged:
        work.wait()
        reduced.append((n, shard, dist.all_reduce(shard, group=groups.inter, async_op=True)))
    gathered = []
    for n, shard, work in reduced:
        work.wait()
        out = torch.empty(shard.numel() * local, dtype=flat.dtype)
        gathered.append(
            (n, out, collectives.all_gather_single(out, shard, group=groups.intra, async_op=True))
        )
    parts = []
    for n, out, work in gathered:
        work.wait()
        parts.append(out[:n])
    return torch.cat(parts).div_(local * groups.num_nodes)


def wire_bytes(numel: int, element_size: int, groups: HierarchyGroups) -> int:
    """Bytes this rank contributes to a dense hierarchical exchange of ``numel`` elements."""
    chunk = shard_length(numel, groups.local_world_size)
    intra = 2 * chunk * groups.local_world_size if groups.intra is not None else 0
    inter = chunk if groups.inter is not None else 0
    return (intra + inter) * element_size
