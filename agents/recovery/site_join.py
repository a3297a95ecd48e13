"""Joining a generation under a delayed sync: each site to its own freshest state.

Runs in the training process, on every rank of a new generation, after its
default group formed: the recovery of the ``sites`` kind of state, a DDP model
in each site (:class:`SiteRecovery`; an FSDP2 model in each site is
:mod:`agents.recovery.site_shards`'s).  Under DiLoCo the sites' parameters
differ between outer steps, so the rule of the per-step tier (the most advanced rank
anywhere sends its state) would hand one site's work to another.  Instead:

1. **Within each site** the most advanced rank sends its state to the ranks
   of its site behind it or new (:func:`~agents.recovery.state_sync.sync_state`
   on the site's group): a replacement continues its site's inner steps.
2. **Across sites** every rank tells its step and its fragments' outer step
   counts (an all-gather on the generation's control group).
   - A site where no rank holds state (all its nodes are new, or it comes
     back) takes the state of the most advanced site, then the sites' common
     parameters (the anchors): it starts from the global model, and the syncs
     under way count it with weight 0.  The sending site's own parameters are
     left out of what crosses the slow link: the anchors replace them on
     arrival (:func:`without_parameters`, :func:`put_back`), and so are the
     outer buffers it does not need (its own pseudo-gradients of the syncs
     under way are zero: it moved nothing since they started).
   - Where no rank anywhere holds state (a new job), every rank takes rank
     0's parameters and the anchors from them, as DDP's first broadcast
     does across a job: a site's DDP spans only its site.
   - A fragment whose outer step went through on one site but not on another
     (the generation broke while the result was shared inside a site, or
     before its delay ran out) takes that site's result, used when this
     site's own sync is due: no outer step is lost or applied twice.
3. Sites may stand at different steps (a site's inner steps do not wait for
   the others').  Those behind train the missing steps without the step
   boundary's vote (``OuterSync.catch_up_to``); the others' next outer
   sync waits for them.
"""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agents.api import StateMismatchError
from agents.recovery.replicas import live, live_or_durable
from agents.recovery.state_sync import NO_STATE, broadcast_state, map_tensors, sync_state
from agents.state.api import Holdings, Joining, Restored
from agents.sync.outer_step import flatten, write_back
from agents.sync.outer_sync import NOT_PENDING, OuterSync
from agents.sync.site_groups import form_site_groups
from agents.sync.sites import Sites
from orchestrator.state.records import Plan

__all__ = [
    "LeftOut",
    "SiteRecovery",
    "join_sites",
    "put_back",
    "reconcile_fragments",
    "without_parameters",
]

log = logging.getLogger("ringmaster.worker")


class SiteRecovery:
    """The ``sites`` kind: each site to its own freshest state (:func:`join_sites`); where
    no rank of any site holds state, the newest durable checkpoint."""

    def join(self, joining: Joining, holdings: Holdings) -> Restored:
        outer = holdings.outer
        assert outer is not None, "the sites' kind of state has a delayed sync"
        state = live(joining, holdings)
        synced = join_sites(
            outer,
            joining.plan,
            joining.rank,
            state.step,
            state.capture,
            state.restore,
            joining.control,
            joining.timeout,
            state.shared,
        )
        return live_or_durable(joining, synced)


def join_sites(
    outer: OuterSync,
    plan: Plan,
    rank: int,
    mine: int,
    capture: Callable[[], Any],
    restore: Callable[[Any], None],
    control: dist.ProcessGroup | None,
    timeout: timedelta,
    shared: Callable[[tuple[Any, ...]], bool] | None = None,
) -> int:
    """Form the sites' groups and bring each site to its state (see the module docstring).

    Returns:
        The step this rank trains next (``NO_STATE``: no rank of any site holds
        state); ``outer.catch_up_to`` is the most advanced site's.

    Args:
        outer: the worker's outer loop (it keeps the groups).
        plan: the generation joined.
        rank: this worker's global rank in it.
        mine: this rank's completed steps, or ``NO_STATE``.
        capture: this rank's live state (called on a source only).
        restore: loads a live state into the tracked objects.
        control: the generation's gloo control group (None: the default group).
        timeout: the generation's collective timeout (the sites' groups start with it).
        shared: which tensors of a capture every rank of a site at one step holds alike
            (each such rank sends a share: :func:`~agents.recovery.state_sync.sync_state`).
    """
    sites = Sites.of_plan(plan, outer.spec.site_label)
    if len(sites) == 1 and rank == 0:
        log.warning(
            "sync.mode %s with one site: every node has %s=%s, so the site trains alone "
            "and its outer steps apply its own pseudo-gradient; give the nodes of each site "
            "their own %s label (ringmaster run: --label node-1:%s=b)",
            outer.spec.mode.value,
            outer.spec.site_label,
            sites.names[0],
            outer.spec.site_label,
            outer.spec.site_label,
        )
    outer.drop()
    outer.groups = groups = form_site_groups(sites, rank, outer.device, timeout)
    step = sync_state(
        mine, capture, restore, groups.inner_host, data_group=groups.inner, shared=shared
    ).step
    row = torch.tensor([step, *outer.counts], dtype=torch.int64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row, group=control)
    table = torch.stack(rows)
    steps = [int(s) for s in table[:, 0]]
    best = max(steps)
    outer.catch_up_to = max(best, 0)
    if best == NO_STATE:  # a new job: every site starts from rank 0's parameters
        _start_common(outer, control)
        return NO_STATE
    if NO_STATE in steps:
        src = steps.index(best)
        empty = [r for r, s in enumerate(steps) if s == NO_STATE]
        left_out = [*outer.parameters, *outer.not_for_a_new_site()]
        sent = functools.partial(without_parameters, capture, left_out) if rank == src else None
        state = broadcast_state(sent, src, control, receivers=empty)
        for r, s in enumerate(steps):
            if s == NO_STATE:
                table[r] = table[src]
        if step == NO_STATE:
            restore(put_back(state, capture()))  # its own parameters: the anchors follow
            outer.start_from_anchors(best)
            step = best
            log.warning(
                "site %s had no state: it starts from the sites' common parameters at step %d",
                sites.names[groups.index],
                step,
            )
        del state
    reconcile_fragments(outer, table[:, 1:], rank, control)
    return step


def _start_common(outer: OuterSync, control: dist.ProcessGroup | None) -> None:
    """Every rank takes rank 0's parameters, and the anchors from them.

    DDP makes a model's replicas equal by a broadcast from its group's first
    rank, but a site's DDP spans only its site: a script that does not seed its
    model the same on every rank would start each site elsewhere, and the
    sites' anchors would never meet.  The ranks first compare a checksum of
    their parameters: where they are alike already (a script that seeds),
    nothing more crosses between the sites; else one model's bytes do, once,
    as DDP's own broadcast does across a job's ranks.
    """
    params = outer.parameters
    flat = flatten(params)  # host float32 (a GPU model's parameters are copied out)
    data = flat.view(torch.uint8).numpy()  # the vector's bytes, no copy
    mine = torch.tensor([zlib.crc32(data)], dtype=torch.int64)  # type: ignore[arg-type]
    sums = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(sums, mine, group=control)
    if len({int(s) for s in sums}) > 1:
        dist.broadcast(flat, src=0, group=control)
        write_back(params, flat)
    outer.anchor_to_parameters(0)


def reconcile_fragments(
    outer: OuterSync,
    counts: torch.Tensor,
    me: int,
    control: dist.ProcessGroup | None,
    members: Sequence[int] | None = None,
) -> None:
    """Fragments behind another site's outer step count take that site's anchor and momentum.

    Args:
        counts: a row of outer step counts per rank of ``control``, in its rank order.
        me: this rank's row.
        members: each row's global rank (None: the row is the global rank).
    """
    for f in range(outer.fragments):
        column = [int(c) for c in counts[:, f]]
        top = max(column)
        if min(column) == top:
            continue
        src = column.index(top)
        src = members[src] if members is not None else src
        anchor, momentum = outer.anchors[f].clone(), outer.momentum[f].clone()
        dist.broadcast(anchor, src=src, group=control)
        dist.broadcast(momentum, src=src, group=control)
        mine = column[me]
        if mine == top:
            continue
        log.warning(
            "fragment %d: outer step %d went through on another site; taking its result",
            f,
            top,
        )
        if mine + 1 == top and outer.pending_at[f] != NOT_PENDING:
            # this site's own sync: its result is used when it is due, as it would have been
            outer.resolved[f] = (anchor, momentum)
            continue
        outer.anchors[f], outer.momentum[f] = anchor, momentum
        outer.counts[f] = top
        outer.pending_at[f] = NOT_PENDING
        outer.pending_weight[f] = 0.0
        outer.take_anchor(f)


@dataclass(frozen=True)
class LeftOut:
    """In a state sent to a site without state: a tensor left out, whose place the
    receiver's own tensor takes (a parameter, which the anchors then overwrite, or an
    outer buffer it does not need: see
    :meth:`~agents.sync.outer_sync.OuterSync.not_for_a_new_site`)."""


def without_parameters(capture: Callable[[], Any], tensors: Sequence[torch.Tensor]) -> Any:
    """``capture()`` with each tensor that is one of ``tensors`` (the anchored parameters,
    which a model's state dict holds by their own storage, and the idle outer buffers)
    replaced by :class:`LeftOut`."""
    held = {_place(t) for t in tensors}
    return map_tensors(capture(), lambda t: LeftOut() if _place(t) in held else t, torch.Tensor)


def put_back(state: Any, own: Any) -> Any:
    """``state`` with each :class:`LeftOut` replaced by what ``own`` (the receiving
    rank's own state, of the same structure) holds at that place."""
    if isinstance(state, LeftOut):
        if not isinstance(own, torch.Tensor):
            raise StateMismatchError(
                "a site without state got another site's state whose structure differs from "
                "its own (a parameter left out has no counterpart here): do the sites run the "
                "same model?"
            )
        return own
    if isinstance(state, dict) and isinstance(own, dict):
        return {k: put_back(v, own.get(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)) and isinstance(own, (list, tuple)):
        kept = [put_back(v, o) for v, o in zip(state, own, strict=True)]
        return kept if isinstance(state, list) else tuple(kept)
    return state


def _place(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], torch.dtype]:
    """Where a tensor's values lie: two tensors at one place are the same values."""
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.dtype)
