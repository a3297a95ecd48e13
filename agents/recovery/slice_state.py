"""The parts of a sharded slice beside its rows: which keys it has, the state it shares.

Runs in the training process, for :mod:`agents.recovery.shard_recovery`.  A
generation being joined needs, besides the rows that move rank to rank, the
structure of the old slices (every key: a pipeline's stages hold different
ones), the tensors to receive the new slice into (the optimizers' state
wrapped as DTensors around them), and the *replicated* state: optimizer
hyperparameters and scalars, buffers, the other tracked objects and the RNG.
That comes from one rank for the whole model, or for a pipeline from a rank of
each stage (a stage's buffers and per-parameter scalars are its own).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from agents.recovery import shard_transfer
from agents.recovery.state_sync import broadcast_state
from agents.state.sharding import PARAM, Layout, ShardedModel, Slice, SliceKey

__all__ = ["apply_replicated", "replicated_for", "structure_of", "targets_for"]


def structure_of(
    gathered: list[Any], tp: shard_transfer.TransferPlan
) -> dict[SliceKey, tuple[torch.dtype, tuple[int, ...]]]:
    """Every key of the old layout's slices (a pipeline's stages hold different ones)."""
    out: dict[SliceKey, tuple[torch.dtype, tuple[int, ...]]] = {}
    for g in gathered:
        out.update(g[2].get((tp.step, tp.old), {}))
    return out


def replicated_for(
    model: ShardedModel,
    slices: list[Slice],
    gathered: list[Any],
    tp: shard_transfer.TransferPlan,
    new: list[Layout],
    rank: int,
    control: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """The replicated state this rank takes: one source's for the whole model, or for
    a pipeline each stage's own (its buffers and per-parameter scalars are its own)."""
    shape = model.mesh_shape

    def stage(index: int) -> int:
        return shape.stage(Layout(tp.old, index)) if model.runner and shape else 0

    sources: dict[int, int] = {}  # stage → the lowest rank holding one of its slices
    for r, g in enumerate(gathered):
        for step, shards, index, has_replicated in g[0]:
            if (step, shards) == (tp.step, tp.old) and has_replicated:
                sources[stage(index)] = min(sources.get(stage(index), r), r)
    mine: dict[str, Any] = {}
    for st, src in sorted(sources.items()):
        takers = [r for r, lay in enumerate(new) if stage(lay.index) == st and r != src]
        got = broadcast_state(
            (lambda st=st: _replicated_of(slices, tp.step, tp.old, st, stage))  # type: ignore[misc]
            if rank == src
            else None,
            src,
            control,
            receivers=takers,
        )
        if stage(new[rank].index) == st:
            # the source's own holding lives on: the new objects get a copy
            mine = copy.deepcopy(got) if rank == src else got
    return mine


def _replicated_of(
    slices: list[Slice], step: int, shards: int, stage: int, stage_of: Any
) -> dict[str, Any]:
    for sl in slices:
        at = (sl.step, sl.layout.shards, stage_of(sl.layout.index))
        if at == (step, shards, stage) and sl.replicated:
            return sl.replicated
    raise AssertionError("planned as the source of replicated state without holding it")


def targets_for(
    model: ShardedModel,
    fresh: torch.nn.Module,
    structure: dict[SliceKey, tuple[torch.dtype, tuple[int, ...]]],
    optimizers: dict[str, torch.optim.Optimizer],
) -> tuple[dict[SliceKey, torch.Tensor], dict[str, dict[str, dict[str, Any]]]]:
    """Tensors to fill for the new slice, and the optimizers' new state around them."""
    params = model.building.params
    targets: dict[SliceKey, torch.Tensor] = {}
    states: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in optimizers}
    for key, (dtype, trailing) in structure.items():
        fqn, sub = key
        if fqn not in params:
            continue  # another pipeline stage's
        if sub == PARAM:
            targets[key] = model.local_rows(fqn, fresh)
            continue
        oname, skey = sub.split(".", 1)
        p = params[fqn]
        assert isinstance(p, DTensor)
        # a state tensor shaped like its parameter (momentum, Adam's moments)
        mine = model.local_rows(fqn, fresh)
        if tuple(mine.shape[1:]) != trailing:
            raise RuntimeError(
                f"optimizer {oname!r} holds {skey!r} of {fqn} shaped {trailing} after dimension "
                f"0, the parameter {tuple(mine.shape[1:])}: only state shaped like its parameter "
                "is sharded"
            )
        local = torch.empty(mine.shape, dtype=dtype, device=p.device)
        targets[key] = local
        states.setdefault(oname, {}).setdefault(fqn, {})[skey] = DTensor.from_local(
            local,
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=p.shape,
            stride=_contiguous_stride(tuple(p.shape)),
        )
    return targets, states


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def apply_replicated(
    fresh: torch.nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    others: dict[str, Any],
    states: dict[str, dict[str, dict[str, Any]]],
    replicated: dict[str, Any],
) -> None:
    with torch.no_grad():
        buffers = dict(fresh.named_buffers())
        for name, value in replicated["buffers"].items():
            buffers[name].copy_(value)
    for oname, opt in optimizers.items():
        for group, saved in zip(opt.param_groups, replicated["groups"].get(oname, []), strict=True):
            group.update(saved)
        for fqn, scalars in replicated["scalars"].get(oname, {}).items():
            states.setdefault(oname, {}).setdefault(fqn, {}).update(
                {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
            )
    for name, st in replicated["objects"].items():
        if name in others:
            others[name].load_state_dict(st)
    torch.set_rng_state(replicated["rng"])
