"""Joining a generation with an FSDP2 model in each site under a delayed sync.

Runs in the training process, on every rank of a new generation, after its
default group formed (:mod:`agents.runtime.generation` calls :func:`join_site_shards`
for ``sharding="fsdp"`` under ``sync.mode`` diloco or streaming_diloco).  Each
site is an FSDP2 group of its own: its model is sharded over the site's ranks
only (a 1-D mesh of the site's group), so no per-step collective crosses
sites.  The sites must be equal-sized (:func:`check_sites`): rank ``i`` of every
site then holds the same slice, and the slice's outer state (anchors,
momentum, the syncs under way) is synced with the same-index ranks of the
other sites (:class:`~agents.sync.outer_sync.OuterSync` with a ``local``
view; its groups are :func:`~agents.sync.site_groups.form_site_groups`'s
``per_slice`` ones).

A site *keeps* its state when every one of its ranks kept its live slice,
at the same step and in the same layout.  Then:

1. **Every site keeps its state**: each rank rebuilds its module on the new
   group from its own slice (no bytes move).
2. **A site does not** (a node of it was replaced, it lost a rank, or it comes
   back): its ranks start from the global model, as a whole site coming back
   does under DDP (:mod:`agents.sync.site_join`): rank ``i`` takes the slice
   of rank ``i`` of the most advanced site that kept its state (its optimizer
   state, its replicated state) and that rank's outer state, and its
   parameters become the anchors.  The syncs under way count the site with
   weight 0.  Its inner steps since the last outer step are lost (at most
   ``inner_steps`` steps of one site's work); no outer step is lost or applied
   twice: a site that missed an outer step another site applied takes its
   result (:func:`~agents.sync.site_join.reconcile_fragments`, per slice).
3. **No site keeps its state**: a new job starts from the script's initial
   values, every site from the first site's; a job whose state was held
   somewhere but in no complete site raises :class:`StateLostError` (durable
   checkpoints are not written for this model in this release:
   :mod:`agents.runtime.saving` says so when a save is due).
"""

from __future__ import annotations

import logging
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from agents.api import StateLostError, StateMismatchError, WorkerView
from agents.recovery.shard_recovery import (
    SOURCE_INITIAL,
    SOURCE_LIVE,
    SOURCE_PEER,
    ShardsRestored,
)
from agents.recovery.slice_state import apply_replicated, targets_for
from agents.recovery.state_sync import NO_STATE, broadcast_state
from agents.runtime.sharding import Layout, ShardedModel, Slice
from agents.runtime.tracked_optimizers import optimizers_of, others_of
from agents.sync.outer_step import flatten, write_back
from agents.sync.outer_sync import OuterSync
from agents.sync.site_groups import SiteGroups, form_site_groups
from agents.sync.site_join import reconcile_fragments
from agents.sync.sites import Sites
from orchestrator.records import Plan

__all__ = ["check_sites", "join_site_shards", "site_steps"]

log = logging.getLogger("ringmaster.worker")


def check_sites(sites: Sites, label: str) -> None:
    """An FSDP2 model in each site needs sites of one size (rank ``i`` of each holds
    slice ``i``).

    Raises:
        StateMismatchError: (a ``ValueError``) naming each site's size and what to
            change; the join reports it as the script's error and the job fails.
    """
    sizes = {len(r) for r in sites.ranks}
    if len(sizes) > 1:
        each = ", ".join(f"{n}: {len(r)}" for n, r in zip(sites.names, sites.ranks, strict=True))
        raise StateMismatchError(
            f"sharding='fsdp' under a delayed sync shards the model over each site's ranks "
            f"and syncs slice i between the sites' i-th ranks, so the sites must have as "
            f"many ranks each; by {label} they have {each}: give every site as many nodes "
            "(nodes.min/max, spares per site), or wrap with sharding='ddp'"
        )


def site_steps(steps: list[int], sites: Sites) -> list[int]:
    """Per site, the step all its ranks kept (``steps``: per global rank, the step of
    its live slice or ``NO_STATE``), or ``NO_STATE`` where a rank kept none or the
    ranks disagree."""
    out = []
    for ranks in sites.ranks:
        held = {steps[r] for r in ranks}
        out.append(held.pop() if len(held) == 1 else NO_STATE)
    return out


def join_site_shards(
    outer: OuterSync,
    model: ShardedModel,
    held: WorkerView,
    holds_state: bool,
    plan: Plan,
    rank: int,
    device: torch.device,
    control: dist.ProcessGroup | None,
    timeout: timedelta,
) -> ShardsRestored:
    """Form the sites' groups, shard the model over this rank's site and bring its slice
    and outer state to the site's state, or to the global model (module docstring).

    Args:
        outer: the worker's outer loop (it keeps the groups).
        model: the sharded model.
        held: the worker as it stands (its step and tracked objects).
        holds_state: the tracked objects hold the state of ``held.step``.
        plan: the generation joined.
        rank: this worker's global rank in it.
        device: this worker's device.
        control: the generation's gloo control group (None: the default group).
        timeout: the generation's collective timeout (the sites' groups start with it).

    Raises:
        StateMismatchError: the sites differ in size (:func:`check_sites`).
        StateLostError: state was held, but no site kept all of its slices.
    """
    sites = Sites.of_plan(plan, outer.spec.site_label)
    check_sites(sites, outer.spec.site_label)
    outer.drop()
    outer.groups = groups = form_site_groups(sites, rank, device, timeout, per_slice=True)
    mine = sites.ranks[groups.index]
    layout = Layout(len(mine), mine.index(rank))
    kept = holds_state and model.layout == layout
    row = torch.tensor([held.step if kept else NO_STATE, int(holds_state)], dtype=torch.int64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row, group=control)
    steps = site_steps([int(r[0]) for r in rows], sites)
    best = max(steps)
    outer.catch_up_to = max(best, 0)
    optimizers = optimizers_of(held.tracked)
    others = others_of(held.tracked, model)
    own = model.capture(held.step, optimizers, others).copy_to_host() if kept else None
    ranks = torch.tensor(mine, dtype=torch.int64)
    mesh = DeviceMesh.from_group(groups.inner, device.type, mesh=ranks, mesh_dim_names=("shard",))
    fresh = model.build(mesh, layout, device)
    if best == NO_STATE:
        if any(int(r[1]) for r in rows):
            raise StateLostError(
                "sharding='fsdp' under a delayed sync: no site kept all of its slices (each "
                "site lost a rank, or the sites changed size at once), and this model "
                "writes no durable checkpoint to resume from; keep the sites' sizes, or "
                "wrap with sharding='ddp'"
            )
        _start_initial(model, fresh, optimizers)
        outer.fit()
        _start_common(outer, groups)
        return ShardsRestored(0, SOURCE_INITIAL, 0)
    empty = [s for s, at in enumerate(steps) if at == NO_STATE]
    state: dict[str, Any] | None = None
    if empty:  # the same decision on every rank: the group of this slice index sends
        src = sites.ranks[steps.index(best)][layout.index]
        receivers = [sites.ranks[s][layout.index] for s in empty]
        sent = None
        if rank == src:  # dicts and lists: the tensors travel apart from the pickled rest
            assert own is not None
            sent = {"tensors": own.tensors, "replicated": own.replicated}
            sent["outer"] = outer.state_dict()
        state = broadcast_state(
            (lambda: sent) if rank == src else None, src, groups.outer,
            receivers=receivers, data_group=groups.outer,
        )  # fmt: skip
    taken = own
    if steps[groups.index] == NO_STATE:
        assert state is not None, "a site that kept no state receives one"
        taken = Slice(best, layout, state["tensors"], state["replicated"])
    assert taken is not None
    _restore_slice(model, fresh, taken, optimizers, others)
    outer.fit()
    step, source = steps[groups.index], SOURCE_LIVE
    if step == NO_STATE:
        assert state is not None
        outer.load_state_dict(state["outer"])
        outer.start_from_anchors()
        step, source = best, SOURCE_PEER
        log.warning(
            "site %s had no state: it starts from the sites' common parameters at step %d",
            sites.names[groups.index], step,
        )  # fmt: skip
    _reconcile(outer, groups)
    return ShardsRestored(step, source, 0)


def _restore_slice(
    model: ShardedModel,
    fresh: torch.nn.Module,
    taken: Slice,
    optimizers: dict[str, torch.optim.Optimizer],
    others: dict[str, Any],
) -> None:
    """Fill the module being built (and the optimizers' state) from a whole slice of
    its layout, and switch to it."""
    targets, states = targets_for(model, fresh, taken.structure(), optimizers)
    with torch.no_grad():
        for key, target in targets.items():
            target.copy_(taken.tensors[key])
    assert taken.replicated is not None, "a live slice carries the replicated state"
    apply_replicated(fresh, optimizers, others, states, taken.replicated)
    model.adopt(optimizers, states)


def _start_initial(
    model: ShardedModel, fresh: torch.nn.Module, optimizers: dict[str, torch.optim.Optimizer]
) -> None:
    """A new job: the slices from the script's module (no collective)."""
    initial = model.initial
    with torch.no_grad():
        if initial is not None:
            model.fill_from(dict(initial.named_parameters()), fresh)
            buffers = dict(fresh.named_buffers())
            for name, b in initial.named_buffers():
                buffers[name].copy_(b)
        else:  # a worker that trained, among ranks that lost everything: no values
            for name in model.rows:
                model.local_rows(name, fresh).zero_()
    model.adopt(optimizers, {})


def _start_common(outer: OuterSync, groups: SiteGroups) -> None:
    """Every site takes the first site's slices (a script that does not seed alike starts
    its sites apart), and the anchors from them: as
    :mod:`agents.sync.site_join` does for a DDP model, per slice index."""
    assert groups.outer is not None
    at = groups.sites.ranks[groups.index].index(dist.get_rank())
    first = groups.sites.ranks[0][at]  # the first site's rank of this slice index
    params = outer.parameters
    flat = flatten(params)
    data = flat.view(torch.uint8).numpy()
    mine = torch.tensor([zlib.crc32(data)], dtype=torch.int64)  # type: ignore[arg-type]
    sums = [torch.zeros_like(mine) for _ in range(len(groups.sites))]
    dist.all_gather(sums, mine, group=groups.outer)
    if len({int(s) for s in sums}) > 1:
        dist.broadcast(flat, src=first, group=groups.outer)
        write_back(params, flat)
    outer.anchor_to_parameters(0)


def _reconcile(outer: OuterSync, groups: SiteGroups) -> None:
    """A slice index's ranks that missed an outer step another site's applied take it."""
    assert groups.outer is not None
    at = groups.sites.ranks[groups.index].index(dist.get_rank())
    members = [ranks[at] for ranks in groups.sites.ranks]
    row = torch.tensor(outer.counts, dtype=torch.int64)
    rows = [torch.zeros_like(row) for _ in members]
    dist.all_gather(rows, row, group=groups.outer)
    reconcile_fragments(outer, torch.stack(rows), groups.index, groups.outer, members)
