"""Joining a generation with an FSDP2 model in each site under a delayed sync.

Runs in the training process, on every rank of a new generation, after its
default group formed: the recovery of the ``site_slices`` kind of state
(:class:`SiteSliceRecovery`, for ``sharding="fsdp"`` under ``sync.mode``
diloco or streaming_diloco).  Each
site is an FSDP2 group of its own: its model is sharded over the site's ranks
only (a 1-D mesh of the site's group), so no per-step collective crosses
sites.  The sites must be equal-sized
(:func:`~agents.recovery.site_plan.check_sites`): rank ``i`` of every site
then holds the same slice, and the slice's outer state (anchors, momentum,
the syncs under way) is synced with the same-index ranks of the other sites
(:class:`~agents.sync.outer_sync.OuterSync` with a ``local`` view; its groups
are :func:`~agents.sync.site_groups.form_site_groups`'s ``per_slice`` ones).
With redundancy on, each rank's slice is copied to the same local rank on
the next node of its site (:class:`~agents.state.buddy_copies.BuddyCopies`
with the site as its ring).

Where each site's slices come from is decided by
:func:`~agents.recovery.site_plan.site_states` from what every rank tells:

1. **A site keeps its state**: every rank that kept its live slice stands at
   the site's step and rebuilds its module on the new group from it (no bytes
   move); a replacement in the site (same layout) takes its slice from the
   buddy's copy of that step, held by a live rank of the site, and its outer
   state from the same-index rank of a site that kept its own (the anchors
   and momentum are the sites' common values; the site's own
   pseudo-gradient of that slice in a sync under way is lost: weight 0).
   The site's inner steps are kept.
2. **A site keeps none** (no buddy copy of a lost slice at the site's step,
   the site's size changed, or the site comes back whole): its ranks start
   from the global model, as a whole site coming back does under DDP
   (:mod:`agents.recovery.site_join`): rank ``i`` takes the slice of rank ``i``
   of the most advanced site that kept its state (its optimizer state, its
   replicated state) and that rank's outer state, and its parameters become
   the anchors.  The syncs under way count the site with weight 0.  Its
   inner steps since the last outer step are lost.
3. **No site keeps its state**: the newest durable checkpoint is resumed
   (the first site's slices, resharded by DCP to every site; each rank's
   outer state saved on the same sites and ranks, the first site's handed to
   the others: :mod:`agents.runtime.outer_checkpoint`, or, saved on other
   sites, cut anew: :mod:`agents.recovery.outer_reshard`); without one, a new
   job starts from the script's initial values, every site from the first
   site's, and a job whose state was held somewhere raises
   :class:`StateLostError`.

No outer step is lost or applied twice: a slice that missed an outer step
another site applied takes its result
(:func:`~agents.recovery.site_join.reconcile_fragments`, per slice index).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from agents.api import StateLostError
from agents.recovery.outer_reshard import reshard_from_checkpoint
from agents.recovery.shard_recovery import (
    SOURCE_BUDDY,
    SOURCE_DURABLE,
    SOURCE_INITIAL,
    SOURCE_LIVE,
    SOURCE_PEER,
    ShardsRestored,
    start_initial,
)
from agents.recovery.site_join import reconcile_fragments
from agents.recovery.site_plan import Held, SiteState, check_sites, site_states
from agents.recovery.slice_state import apply_replicated, targets_for
from agents.recovery.state_sync import NO_STATE, broadcast_state
from agents.state.api import Holdings, Joining, Restored
from agents.state.buddy_copies import BuddyCopies
from agents.state.sharding import Layout, ShardedModel, Slice
from agents.state.tracked_optimizers import optimizers_of, others_of
from agents.sync.outer_step import flatten, write_back
from agents.sync.outer_sync import OuterSync
from agents.sync.site_groups import SiteGroups, form_site_groups
from agents.sync.sites import Sites

__all__ = ["SiteSliceRecovery", "join_site_shards"]

log = logging.getLogger("ringmaster.worker")


class SiteSliceRecovery:
    """The ``site_slices`` kind: an FSDP2 model in each site (:func:`join_site_shards`)."""

    def join(self, joining: Joining, holdings: Holdings) -> Restored:
        outer, model = holdings.outer, holdings.sharded
        assert outer is not None and model is not None, "sites of a sharded model"
        got = join_site_shards(joining, outer, model, holdings.buddies)
        has_state = joining.holds_state or got.source != SOURCE_INITIAL
        return Restored(got.step, has_state, got.restored_from, got.source, got.lost)


def join_site_shards(
    at: Joining, outer: OuterSync, model: ShardedModel, buddies: BuddyCopies | None
) -> ShardsRestored:
    """Form the sites' groups, shard the model over this rank's site and bring its slice
    and outer state to the site's state, or to the global model (module docstring).

    Args:
        at: the join (the sites' groups start with its collective timeout).
        outer: the worker's outer loop (it keeps the groups).
        model: the sharded model.
        buddies: its buddy copies in the site, if redundancy is on (started here on
            the new generation).

    Raises:
        StateMismatchError: the sites differ in size (:func:`check_sites`).
        StateLostError: state was held, but no site kept all of its slices.
    """
    rank, held, holds_state, control = at.rank, at.held, at.holds_state, at.control
    sites = Sites.of_plan(at.plan, outer.spec.site_label)
    check_sites(sites, outer.spec.site_label)
    outer.drop()
    outer.groups = groups = form_site_groups(sites, rank, at.device, at.timeout, per_slice=True)
    mine = sites.ranks[groups.index]
    layout = Layout(len(mine), mine.index(rank))
    kept = holds_state and model.layout == layout
    ward = buddies.held_copy() if buddies is not None and kept else None
    copy = (ward.step, ward.layout.shards, ward.layout.index) if ward is not None else None
    row = torch.tensor(Held(held.step if kept else NO_STATE, holds_state, copy).encode())
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row, group=control)
    told = [Held.decode(r.tolist()) for r in rows]
    states = site_states(told, sites)
    steps = [st.step for st in states]
    best = max(steps)
    outer.catch_up_to = max(best, 0)
    optimizers = optimizers_of(held.tracked)
    others = others_of(held.tracked, model)
    own = model.capture(held.step, optimizers, others).copy_to_host() if kept else None
    ranks = torch.tensor(mine, dtype=torch.int64)
    device = at.device
    mesh = DeviceMesh.from_group(groups.inner, device.type, mesh=ranks, mesh_dim_names=("shard",))
    fresh = model.build(mesh, layout, device)
    if best == NO_STATE:
        start_initial(model, fresh, optimizers)  # a new job: no collective
        outer.fit()
        outer.saved_sites = None
        durable = at.durable
        resumed = durable.resume(at.plan.world_size) if durable.can_resume() else None
        _start_copies(buddies, at, sites, model, NO_STATE)
        newest = max(h.live for h in told)
        if resumed is not None:
            _outer_from_checkpoint(outer, model, groups, control)
            outer.catch_up_to = resumed.step
            lost = max(0, newest - resumed.step)
            return ShardsRestored(resumed.step, SOURCE_DURABLE, lost, resumed.url)
        if any(h.state for h in told):
            raise StateLostError(
                "sharding='fsdp' under a delayed sync: no site kept all of its slices (a "
                "rank of each site was lost with no buddy copy of its slice at the site's "
                f"step, or the sites changed size at once), and no durable checkpoint exists "
                f"under {durable.url}; set checkpoint.every_steps, or "
                "fault_tolerance.redundancy.every_steps: 1, and keep the sites' sizes"
            )
        _start_common(outer, groups)
        return ShardsRestored(0, SOURCE_INITIAL, 0)
    site = states[groups.index]
    taken = _from_copies(site, groups, layout, own, ward, rank)
    empty = [s for s, step in enumerate(steps) if step == NO_STATE]
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
            _given(sent) if rank == src else None,
            src,
            groups.outer,
            receivers=receivers,
            data_group=groups.outer,
        )
    if site.step == NO_STATE:
        assert state is not None, "a site that kept no state receives one"
        taken = Slice(best, layout, state["tensors"], state["replicated"])
    assert taken is not None
    _restore_slice(model, fresh, taken, optimizers, others)
    outer.fit()
    step, source = site.step, (SOURCE_BUDDY if site.copies else SOURCE_LIVE)
    if step == NO_STATE:
        assert state is not None
        outer.load_state_dict(state["outer"])
        outer.start_from_anchors(best)
        step, source = best, SOURCE_PEER
        log.warning(
            "site %s had no state: it starts from the sites' common parameters at step %d",
            sites.names[groups.index],
            step,
        )
    _outer_for_copies(outer, groups, states, layout.index, step)
    _reconcile(outer, groups)
    _start_copies(buddies, at, sites, model, step if site.step != NO_STATE else NO_STATE)
    return ShardsRestored(step, source, 0)


def _given(value: Any) -> Callable[[], Any]:
    return lambda: value


def _from_copies(
    site: SiteState,
    groups: SiteGroups,
    layout: Layout,
    own: Slice | None,
    ward: Slice | None,
    rank: int,
) -> Slice | None:
    """A site that keeps its state: each rank that kept none (a replacement) takes its
    slice from the buddy's copy in the site, with the sender's replicated state; the
    others keep their own.  Collective on the site's gloo group."""
    taken = own
    mine = groups.sites.ranks[groups.index]
    for index, holder in sorted(site.copies.items()):
        sent = None
        if rank == holder:
            assert own is not None and ward is not None
            sent = {"tensors": ward.tensors, "replicated": own.replicated}
        got = broadcast_state(
            _given(sent) if rank == holder else None,
            holder,
            groups.inner_host,
            receivers=[mine[index]],
            data_group=groups.inner,
        )
        if rank == mine[index]:
            taken = Slice(site.step, layout, got["tensors"], got["replicated"])
            log.warning(
                "slice %d of site %s of step %d restored from its buddy's copy in the site",
                index,
                groups.sites.names[groups.index],
                site.step,
            )
    return taken


def _outer_from_checkpoint(
    outer: OuterSync, model: ShardedModel, groups: SiteGroups, control: dist.ProcessGroup | None
) -> None:
    """After a durable resume: every site takes the first site's outer state of each
    slice (its model is the first site's now), cut anew where it was saved on other
    sites (:mod:`agents.recovery.outer_reshard`), or none where the checkpoint holds
    none (saved under ``sync.mode: ddp``: :meth:`~agents.sync.outer_sync.OuterSync.resume`
    then takes the anchors from the parameters).

    Raises:
        StorageFaultError: the checkpoint's outer state was saved on more ranks than
            this generation has.
    """
    current = [list(r) for r in groups.sites.ranks]
    saved = outer.saved_sites
    mine = torch.tensor([0 if saved is None else 1 if saved == current else -1])
    told = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(told, mine, group=control)
    found = {int(t) for t in told}
    if -1 in found or found == {0, 1}:
        reshard_from_checkpoint(outer, model, groups, control)
        return
    if found == {0}:
        return
    assert groups.outer is not None
    at = current[groups.index].index(dist.get_rank())
    src = current[0][at]
    receivers = [ranks[at] for ranks in current[1:]]
    got = broadcast_state(
        _given(outer.state_dict()) if dist.get_rank() == src else None,
        src,
        groups.outer,
        receivers=receivers,
        data_group=groups.outer,
    )
    if dist.get_rank() in receivers:
        outer.load_state_dict(got)


def _outer_for_copies(
    outer: OuterSync, groups: SiteGroups, states: list[SiteState], index: int, step: int
) -> None:
    """A rank whose slice came from a buddy's copy takes its slice's outer state from
    the same-index rank of a site that kept its own (:func:`site_states` made sure
    one did).  Collective on the group of slice ``index``."""
    assert groups.outer is not None
    sites = groups.sites
    receivers = [sites.ranks[s][index] for s, st in enumerate(states) if index in st.copies]
    if not receivers:
        return
    src = next(
        sites.ranks[s][index]
        for s, st in enumerate(states)
        if st.step != NO_STATE and index not in st.copies
    )
    rank = dist.get_rank()
    got = broadcast_state(
        _given(outer.state_dict()) if rank == src else None,
        src,
        groups.outer,
        receivers=receivers,
        data_group=groups.outer,
    )
    if rank in receivers:
        outer.take_from_another_site(got, step)


def _start_copies(
    buddies: BuddyCopies | None,
    at: Joining,
    sites: Sites,
    model: ShardedModel,
    step: int,
) -> None:
    """Start the buddy copies on the new generation, each rank's buddy in its own site
    (``step``: the site's state, NO_STATE where it took none of its own copies)."""
    if buddies is None:
        return
    buddies.forget_after(step)
    layouts = [Layout(1, 0)] * at.plan.world_size
    for ranks in sites.ranks:
        for i, r in enumerate(ranks):
            layouts[r] = Layout(len(ranks), i)
    mine = next(ranks for ranks in sites.ranks if at.rank in ranks)
    world = at.plan.world_size
    buddies.start(at.rank, world, at.nproc, layouts, model.rows, at.copies_timeout, mine)


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


def _start_common(outer: OuterSync, groups: SiteGroups) -> None:
    """Every site takes the first site's slices (a script that does not seed alike starts
    its sites apart), and the anchors from them: as
    :mod:`agents.recovery.site_join` does for a DDP model, per slice index."""
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
