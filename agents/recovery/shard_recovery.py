"""Joining a generation with a sharded model: every rank gets its slice, best source first.

Runs in the training process: the recovery of the ``slices`` kind of state
(:class:`SliceRecovery`), which the runtime (:mod:`agents.runtime.generation`)
calls once the generation's process group has formed.  Each rank lists the
slices it holds (its live one; with redundancy, its own snapshots and its
ward's copy, :mod:`agents.state.buddy_copies`), the ranks agree on the newest
step at which some layout is complete (:func:`agents.recovery.shard_transfer.plan`),
the new sharded module is built on the generation's mesh and the rows move
rank to rank.  Where no complete set is held in memory, the newest durable
checkpoint is loaded and resharded by DCP (each rank reads its own slice); a
fresh job takes the script's initial values.  :func:`join` returns what served
and how many completed steps were lost (:class:`ShardsRestored`); the runtime
puts them into the worker's telemetry (:class:`~agents.state.api.Restored`'s
``source`` and ``lost``), and from there they reach the recovery record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from agents.api import DurableState, StateLostError, WorkerView
from agents.recovery import shard_transfer
from agents.recovery.slice_state import (
    apply_replicated,
    replicated_for,
    structure_of,
    targets_for,
)
from agents.recovery.state_sync import NO_STATE
from agents.state.api import Holdings, Joining, Restored
from agents.state.sharding import (
    PARAM,
    Layout,
    ShardedModel,
    Slice,
    SliceKey,
    layout_of,
)
from agents.state.tracked_optimizers import optimizers_of, others_of

if TYPE_CHECKING:
    from agents.state.buddy_copies import BuddyCopies

__all__ = [
    "SOURCE_BUDDY",
    "SOURCE_DURABLE",
    "SOURCE_INITIAL",
    "SOURCE_LIVE",
    "SOURCE_PEER",
    "SOURCE_SNAPSHOT",
    "SOURCE_TWIN",
    "Placement",
    "ShardsRestored",
    "SliceRecovery",
    "join",
    "layouts",
    "start_initial",
]

log = logging.getLogger("ringmaster.worker")

#: Names of where a generation's state came from (``Telemetry.restored_from``).
SOURCE_TWIN = "twin"  # a live rank of another replica group (hsdp)
SOURCE_PEER = "peer"  # a live rank's memory, redistributed (fsdp, world-size change)
SOURCE_BUDDY = "buddy"  # a buddy's host-memory copy
SOURCE_SNAPSHOT = "snapshot"  # a rank's own last snapshot (rolled back to the copies' step)
SOURCE_LIVE = "live"  # every rank kept its own slice
SOURCE_DURABLE = "durable"
SOURCE_INITIAL = "initial"


class SliceRecovery:
    """The ``slices`` kind: each rank's slice from its best source (:func:`join`), then
    the buddy copies start again on the new generation."""

    def join(self, joining: Joining, holdings: Holdings) -> Restored:
        model, buddies = holdings.sharded, holdings.buddies
        assert model is not None, "the slices' kind of state has a sharded model"
        world = joining.world_size
        placement = Placement(joining.rank, world, joining.plan.members[0].nproc, joining.device)
        got = join(
            joining.held,
            joining.holds_state,
            model,
            buddies,
            placement,
            joining.durable,
            joining.control,
        )
        if buddies is not None:
            buddies.forget_after(got.step)
            buddies.start(
                joining.rank,
                world,
                joining.nproc,
                layouts(model, placement),
                model.rows,
                joining.copies_timeout,
            )
        has_state = joining.holds_state or got.source != SOURCE_INITIAL
        return Restored(got.step, has_state, got.restored_from, got.source, got.lost)


@dataclass(frozen=True)
class Placement:
    """Where this rank trains in the generation being joined."""

    rank: int
    world_size: int
    #: workers of one node (the default ``hsdp`` shard group)
    node_size: int
    device: torch.device


@dataclass(frozen=True)
class ShardsRestored:
    """The state a sharded model's slices were brought to (the caller applies it)."""

    #: the step the slices hold (the step trained next)
    step: int
    #: what served them (one of the ``SOURCE_*`` names)
    source: str
    #: completed steps lost (the newest live step minus ``step``)
    lost: int
    #: the durable checkpoint read, when that served
    restored_from: str | None = None


@dataclass(frozen=True)
class _Holding:
    """One slice this rank can serve, and what kind it is."""

    kind: str  # live, snapshot, buddy
    slice: Slice


def shard_size(model: ShardedModel, placement: Placement) -> int:
    return model.shard_size or placement.node_size


def layouts(model: ShardedModel, placement: Placement) -> list[Layout]:
    """Every rank's layout in the generation being joined."""
    size, world = shard_size(model, placement), placement.world_size
    return [layout_of(model.mode, r, world, size) for r in range(world)]


def join(
    held: WorkerView,
    holds_state: bool,
    model: ShardedModel,
    buddies: BuddyCopies | None,
    placement: Placement,
    durable: DurableState,
    control: dist.ProcessGroup | None,
) -> ShardsRestored:
    """Bring this rank's slice of ``model`` (and the optimizers) to the newest state.

    Args:
        held: the worker as it stands (its step and tracked objects).
        holds_state: the tracked objects hold the state of ``held.step``.
        model: the sharded model.
        buddies: its buddy copies, if redundancy is on.
        placement: this rank in the generation being joined.
        durable: the durable checkpoints, read when no complete set is in memory.
        control: the generation's gloo group (None: the default group).

    Raises:
        StateLostError: state was lost in memory and no durable checkpoint exists.
    """
    rank, world = placement.rank, placement.world_size
    size = shard_size(model, placement)
    new = layouts(model, placement)
    mesh = model.build_mesh(world, size, placement.device.type)
    holdings = _holdings(held, holds_state, model, buddies)
    mine = [
        (h.slice.step, h.slice.layout.shards, h.slice.layout.index, h.slice.replicated is not None)
        for h in holdings
    ]
    kinds = {(h.slice.step, h.slice.layout.shards, h.slice.layout.index): h.kind for h in holdings}
    structures = {
        (h.slice.step, h.slice.layout.shards): h.slice.structure()
        for h in holdings
        if h.slice.replicated is not None
    }
    live_step = held.step if holds_state else NO_STATE
    dims = _local_dims(holdings) if model.mesh_shape is not None else {}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine, kinds, structures, live_step, dims), group=control)
    held_slices = [g[0] for g in gathered]
    best_live = max(g[3] for g in gathered)
    tp = shard_transfer.plan(held_slices, new)
    optimizers = optimizers_of(held.tracked)
    fresh = model.build(mesh, new[rank], placement.device)
    if tp is not None and model.mesh_shape is not None and tp.old != new[rank].shards:
        log.warning(
            "the mesh's replicas were %d ranks and are %d now: its slices come from the "
            "durable checkpoint (only the replicate dimension changes in memory)",
            tp.old,
            new[rank].shards,
        )
        tp = None
    if tp is None:
        return _from_storage(model, fresh, optimizers, best_live, durable, world)
    rows = _rows(model, gathered, tp)
    structure = structure_of(gathered, tp)
    targets, states = targets_for(model, fresh, structure, optimizers)

    def serve(chunk: int) -> dict[SliceKey, torch.Tensor] | None:
        for h in holdings:  # live first
            lay = h.slice.layout
            if (h.slice.step, lay.shards, lay.index) == (tp.step, tp.old, chunk):
                return h.slice.tensors
        return None

    with torch.no_grad():
        received = shard_transfer.execute(
            tp, rank, new, rows, structure, serve, targets, group=control
        )
    replicated = replicated_for(
        model, [h.slice for h in holdings], gathered, tp, new, rank, control
    )
    apply_replicated(fresh, optimizers, others_of(held.tracked, model), states, replicated)
    model.adopt(optimizers, states)
    source = _source(model.mode, tp, gathered, new, rows)
    lost = max(0, best_live - tp.step)
    log.warning(
        "slices of step %d restored from %s (%d bytes received here, %d steps lost)",
        tp.step,
        source,
        received,
        lost,
    )
    return ShardsRestored(tp.step, source, lost)


def _holdings(
    held: WorkerView, holds_state: bool, model: ShardedModel, buddies: BuddyCopies | None
) -> list[_Holding]:
    out = []
    if holds_state and model.layout is not None:
        others = others_of(held.tracked, model)
        live = model.capture(held.step, optimizers_of(held.tracked), others)
        out.append(_Holding("live", live))
    if buddies is not None:
        for sl in buddies.own_snapshots():
            out.append(_Holding("snapshot", sl))
        ward = buddies.held_copy()
        if ward is not None:
            out.append(_Holding("buddy", ward))
    return out


def _local_dims(holdings: list[_Holding]) -> dict[tuple[int, int, int], dict[str, int]]:
    """Dimension 0 of each parameter's local tensor in each slice held (a mesh's)."""
    return {
        (h.slice.step, h.slice.layout.shards, h.slice.layout.index): {
            fqn: t.shape[0] if t.dim() else 1
            for (fqn, sub), t in h.slice.tensors.items()
            if sub == PARAM
        }
        for h in holdings
    }


def _rows(
    model: ShardedModel, gathered: list[Any], tp: shard_transfer.TransferPlan
) -> shard_transfer.Rows:
    """Where each chunk's rows lie: dimension-0 chunks, or a mesh's local tensors stacked."""
    if model.mesh_shape is None:
        return model.rows
    table: dict[tuple[str, int], int] = {}
    for g in gathered:
        for (step, shards, index), dims in g[4].items():
            if (step, shards) == (tp.step, tp.old):
                table.update({(fqn, index): n for fqn, n in dims.items()})
    return shard_transfer.stacked(table)


def _source(
    mode: str,
    tp: shard_transfer.TransferPlan,
    gathered: list[Any],
    new: list[Layout],
    rows: shard_transfer.Rows,
) -> str:
    """What served the slices: a buddy's copy, a twin or peer, own snapshots, or each its own."""
    keys = [key for key in structure_of(gathered, tp) if key[1] == PARAM]
    used: set[tuple[int, int, str]] = set()  # (receiver, holder, kind)
    for receiver, layout in enumerate(new):
        for piece in shard_transfer.pieces(rows, keys, tp.old, layout):
            holder = tp.holder[(receiver, piece.chunk)]
            used.add((receiver, holder, gathered[holder][1].get((tp.step, tp.old, piece.chunk))))
    if any(kind == "buddy" for _, _, kind in used):
        return SOURCE_BUDDY
    if any(r != h for r, h, _ in used):
        same_layout = tp.old == new[0].shards
        return SOURCE_TWIN if mode in ("hsdp", "mesh") and same_layout else SOURCE_PEER
    if any(kind == "snapshot" for _, _, kind in used):
        return SOURCE_SNAPSHOT
    return SOURCE_LIVE


def start_initial(
    model: ShardedModel, fresh: torch.nn.Module, optimizers: dict[str, torch.optim.Optimizer]
) -> None:
    """This rank's slices from the script's module (no collective); zeros on a worker that
    trained, among ranks that lost everything (no initial values are kept then)."""
    initial = model.initial
    with torch.no_grad():
        if initial is not None:
            model.fill_from(dict(initial.named_parameters()), fresh)
            buffers = dict(fresh.named_buffers())
            for name, b in initial.named_buffers():
                buffers[name].copy_(b)
        else:
            for name in model.rows:
                model.local_rows(name, fresh).zero_()
    model.adopt(optimizers, {})


def _from_storage(
    model: ShardedModel,
    fresh: torch.nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    best_live: int,
    durable: DurableState,
    world_size: int,
) -> ShardsRestored:
    """No complete set of slices in memory: the script's initial values, then durable."""
    start_initial(model, fresh, optimizers)
    lost_state = best_live != NO_STATE
    resumed = durable.resume(world_size) if durable.can_resume() else None
    if resumed is not None:
        lost = max(0, best_live - resumed.step) if lost_state else 0
        if lost_state:
            log.warning(
                "no complete set of slices in memory: resumed from the durable checkpoint "
                "of step %d, %d steps lost",
                resumed.step,
                lost,
            )
        return ShardsRestored(resumed.step, SOURCE_DURABLE, lost, resumed.url)
    if lost_state:
        raise StateLostError(
            f"a slice of the sharded model was lost with every copy of it (newest live step "
            f"{best_live}) and no durable checkpoint exists under {durable.url}; set "
            "checkpoint.every_steps, use sharding='hsdp', or turn on redundancy"
        )
    return ShardsRestored(0, SOURCE_INITIAL, 0)
