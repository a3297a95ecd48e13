"""A slice's outer state resumed on another number of ranks per site (FSDP2 in each site).

Runs in the training process, on every rank, at a durable resume of
``sharding="fsdp"`` under ``sync.mode`` diloco or streaming_diloco
(:func:`agents.recovery.site_shards.join_site_shards`).  Each rank saved the
outer state of its own slice (anchors, outer momentum, the pseudo-gradients of
syncs under way: flat vectors per fragment, each the concatenation of the
slice's rows of the fragment's parameters) with the sites it was saved on
(:mod:`agents.runtime.outer_checkpoint`).  When this generation's sites differ,
the restore has given each rank the part its rank number wrote, if that rank
existed.  The parts of the first saved site's ranks are gathered on every rank
(:func:`reshard_from_checkpoint`), each parameter's rows are put back together,
and each rank cuts out the rows of its slice in this generation's layout
(:func:`reshard_slice`: ``torch.chunk``'s split, as FSDP2's).  Every site takes
them, as every site takes the first site's model.  The anchors and momentum are
the sites' common values, so nothing is approximated; while the state is put
together it is held whole once on each rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from agents.api import StorageFaultError
from agents.state.mesh_layout import Layout, chunk_rows
from agents.state.sharding import ShardedModel
from agents.sync.outer_sync import OuterSync
from agents.sync.site_groups import SiteGroups

__all__ = ["SLICED_KEYS", "reshard_from_checkpoint", "reshard_slice"]

log = logging.getLogger("ringmaster.worker")

#: The entries of an outer state dict that are per fragment flat vectors of a slice's rows.
SLICED_KEYS = ("anchors", "momentum", "pending_delta")


def reshard_slice(
    pieces: Mapping[int, Mapping[str, Any]],
    new: Layout,
    rows: Sequence[int],
    numels: Sequence[int],
    runs: Sequence[Sequence[int]],
) -> dict[str, Any]:
    """The outer state of slice ``new.index`` of ``new.shards`` from the states of the
    old slices ``0 .. len(pieces) - 1`` (``pieces``, by old slice index).

    Args:
        rows / numels: each parameter's rows (dimension 0) and elements, whole.
        runs: the parameters (indices) of each fragment, in order.

    Raises:
        ValueError: a piece does not hold the rows its slice index has.
    """
    old = len(pieces)
    widths = [n // r if r else 0 for n, r in zip(numels, rows, strict=True)]  # per row
    out: dict[str, Any] = {k: v for k, v in pieces[0].items() if k not in SLICED_KEYS}
    for key in SLICED_KEYS:
        out[key] = []
        for f, run in enumerate(runs):
            whole: dict[int, list[torch.Tensor]] = {i: [] for i in run}
            for k in range(old):
                flat, at = pieces[k][key][f], 0
                for i in run:
                    start, stop = chunk_rows(rows[i], Layout(old, k))
                    n = (stop - start) * widths[i]
                    whole[i].append(flat[at : at + n])
                    at += n
                if at != flat.numel():
                    raise ValueError(
                        f"the outer state of slice {k} of {old} holds {flat.numel()} values of "
                        f"fragment {f}, its rows {at}: it was saved from another model"
                    )
            parts = []
            for i in run:
                start, stop = chunk_rows(rows[i], new)
                parts.append(torch.cat(whole[i])[start * widths[i] : stop * widths[i]])
            out[key].append(torch.cat(parts).clone() if parts else torch.zeros(0))
    return out


def reshard_from_checkpoint(
    outer: OuterSync, model: ShardedModel, groups: SiteGroups, control: dist.ProcessGroup | None
) -> None:
    """Every rank's slice's outer state from the parts the first saved site's ranks wrote
    (collective over the world: see the module docstring).

    Raises:
        StorageFaultError: a rank of the first saved site is beyond this generation's
            world (its part was not read): resume on at least as many ranks.
    """
    rank = dist.get_rank()
    saved = outer.saved_piece
    offer = None
    if saved is not None and rank in saved["sites"][0]:
        offer = (saved["sites"][0].index(rank), saved["sites"], saved["state"])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, offer, group=control)
    outer.saved_piece = None
    offers = [g for g in gathered if g is not None]
    sites = offers[0][1] if offers else []
    pieces = {k: state for k, _, state in offers}
    if not offers or len(pieces) != len(sites[0]):
        raise StorageFaultError(
            "the checkpoint resumed holds the outer state of sharding='fsdp' under a delayed "
            f"sync in the parts of ranks {sites[0] if sites else '?'} (its first site), and "
            f"this generation has {dist.get_world_size()} ranks: resume on at least "
            f"{max(sites[0]) + 1 if sites else 'as many'} ranks, or with the nodes per site "
            "it was saved with",
            fault="checkpoint",
        )
    mine = [list(r) for r in groups.sites.ranks][groups.index]
    layout = Layout(len(mine), mine.index(rank))
    names = list(model.rows)
    numels = [model.params[n].numel() for n in names]
    state = reshard_slice(pieces, layout, [model.rows[n] for n in names], numels, outer.runs)
    outer.fit()
    outer.load_state_dict(state)
    if rank == 0:
        log.warning(
            "the outer state was saved on sites of %d rank(s) each and is resharded to %d "
            "(slice %d of them here)",
            len(sites[0]),
            layout.shards,
            layout.index,
        )
