"""Worker functions for the sharded-checkpoint tests (run in gloo processes by ``run_gloo``)."""

from __future__ import annotations

from typing import Any

STEPS = 3


def build(seed: int, hidden: int = 7) -> tuple[Any, Any]:
    """A tiny model (by default rows that do not split evenly over 2 or 3 ranks) and Adam."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 5)
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def full_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """Model and optimizer in full, as lists (gathering DTensors is collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    def plain(t: Any) -> Any:
        if isinstance(t, DTensor):
            t = t.full_tensor()
        return t.tolist() if hasattr(t, "tolist") else t

    opts = StateDictOptions(full_state_dict=False)
    msd = get_model_state_dict(model, options=opts)
    osd: Any = get_optimizer_state_dict(model, optimizer, options=opts)
    return {
        "model": {k: plain(v) for k, v in msd.items()},
        "optim": {f: {k: plain(v) for k, v in st.items()} for f, st in osd["state"].items()},
    }


def wrapped(model: Any, mode: str) -> tuple[Any, Any]:
    """``model`` sharded as ``mode``, and the pipeline runner of its stage (or None).

    ``mode``: ``fsdp``, ``hsdp``, ``ddp``, or a mesh written
    ``mesh:<pipeline>x<shard>x<tensor>`` (replicas: the rest), laid out and cut into
    stages as ``wrap(mesh=...)`` does.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from agents.state.mesh_layout import MeshShape, build_mesh
    from agents.state.pipeline import Pipeline, PipelineRunner, split_stages, stage_of
    from agents.state.tensor_plan import apply_plan, default_plan

    if mode.startswith("mesh:"):
        pipeline, shard, tensor = (int(n) for n in mode[5:].split("x"))
        shape = MeshShape(shard=shard, tensor=tensor, pipeline=pipeline)
        mesh = build_mesh("mesh", dist.get_world_size(), 0, "cpu", shape)
        plan = default_plan(model)
        runner = None
        if pipeline > 1:
            stages = split_stages(model, pipeline, None)
            model = stage_of(model, stages[mesh["pipeline"].get_local_rank()])
            names = dict(model.named_modules())
            plan = {k: v for k, v in plan.items() if k in names}
            runner = PipelineRunner(Pipeline(_square_mean, 2, "gpipe"), pipeline)
        if tensor > 1 and plan:
            apply_plan(model, mesh["tensor"], plan)
        fully_shard(model, mesh=mesh["replicate", "shard"])
        if runner is not None:
            runner.reset(model, mesh, torch.device("cpu"))
        return model, runner
    if mode == "fsdp":
        world = dist.get_world_size()
        fully_shard(model, mesh=DeviceMesh("cpu", torch.arange(world)))
        return model, None
    if mode == "hsdp":
        world = dist.get_world_size()
        grid = torch.arange(world).view(world // 2, 2)
        fully_shard(model, mesh=DeviceMesh("cpu", grid, mesh_dim_names=("replicate", "shard")))
        return model, None
    return DistributedDataParallel(model), None


def stages_of(mode: str, world: int) -> tuple[int, ...] | None:
    """Per rank, the pipeline stage a ``mesh:PxSxT`` mode puts it in (None: no stages)."""
    if not mode.startswith("mesh:"):
        return None
    pipeline, shard, tensor = (int(n) for n in mode[5:].split("x"))
    if pipeline == 1:
        return None
    return tuple(r // (shard * tensor) % pipeline for r in range(world))


def _square_mean(out: Any, target: Any) -> Any:
    return out.pow(2).mean()


def backward(model: Any, runner: Any, data: Any) -> float:
    """Forward and backward of ``mean(model(data) ** 2)``, through the stages if pipelined."""
    if runner is not None:
        return float(runner.step(data, data))  # the target is not read
    loss = model(data).pow(2).mean()
    loss.backward()
    return float(loss)


def train_and_save(rank: int, world: int, url: str, mode: str, hidden: int = 7) -> dict[str, Any]:
    """Train ``STEPS`` steps sharded as ``mode``, save synchronously, return the full state."""
    import torch

    from checkpoint import Checkpointer, TrainState

    model, optimizer = build(seed=0, hidden=hidden)
    model, runner = wrapped(model, mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    data = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
    for _ in range(STEPS):
        optimizer.zero_grad()
        backward(model, runner, data)
        optimizer.step()
    ckpt = Checkpointer(url, keep=3)
    state = TrainState(model, optimizer, samples_seen=STEPS, stages=stages_of(mode, world))
    manifest = ckpt.save_now(STEPS, state)
    ckpt.close()
    return {
        "state": full_state(model, optimizer),
        "objects": [o.path for o in manifest.objects],
        "local_shapes": [tuple(_local(p).shape) for p in model.parameters()],
        "next_loss": next_loss(model, runner, optimizer),
    }


def _local(p: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def next_loss(model: Any, runner: Any, optimizer: Any) -> float:
    """The loss of one more step on a batch every rank shares, after it is taken."""
    import torch

    probe = torch.randn(8, 6, generator=torch.Generator().manual_seed(99))
    optimizer.zero_grad()
    backward(model, runner, probe)
    optimizer.step()
    return backward(model, runner, probe)


def resume(
    rank: int, world: int, url: str, mode: str, hidden: int = 7, save_to: str | None = None
) -> dict[str, Any]:
    """Restore into a differently initialised model sharded as ``mode`` (and save what
    was restored to ``save_to``, when given)."""
    import torch

    from checkpoint import Checkpointer, TrainState

    model, _ = build(seed=1234, hidden=hidden)
    model, runner = wrapped(model, mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    state = TrainState(model, optimizer)
    ckpt = Checkpointer(url, keep=3)
    result = ckpt.restore(state)
    ckpt.close()
    if save_to is not None:
        again = Checkpointer(save_to, keep=3)
        stages = stages_of(mode, world)
        again.save_now(
            result.step, TrainState(model, optimizer, samples_seen=result.step, stages=stages)
        )
        again.close()
    restored = full_state(model, optimizer)
    return {
        "step": result.step,
        "state": restored,
        "next_loss": next_loss(model, runner, optimizer),
    }
