"""Sharded models (FSDP2's ``fully_shard``) that survive a change of process group.

``fully_shard`` binds a module to one device mesh for life, and after a
hot-swap the runtime forms a new process group.  :class:`ShardedModel` keeps
a parameterless *blueprint* of the user's module (its structure on the meta
device) and, for each generation, shards a fresh copy of it on the new mesh;
the parameters' local slices are then filled from wherever this generation's
slice lives (:mod:`agents.recovery.shard_recovery`): this rank's own memory, a twin rank
of another replica group (``hsdp``), a buddy's host-memory copy
(:mod:`agents.state.buddy_copies`), or a durable checkpoint.  The optimizers the
script built on :meth:`ShardedModel.parameters` keep working: their parameter
lists are pointed at the new generation's parameters and their state is put
back under the new ones (:func:`agents.state.tracked_optimizers.repoint_optimizer`).

Modes (``sharding=`` of :meth:`agents.runtime.Session.wrap`):

* ``fsdp``: one shard dimension over every rank (a 1-D mesh, ZeRO-3);
* ``hsdp``: a 2-D ``(replicate, shard)`` mesh in rank order, i.e. topology
  order: ``shard_size`` consecutive ranks (by default one node's workers)
  shard the model, and the groups of them are replicas of each other;
* ``mesh`` (``wrap(mesh=...)``): a ``(replicate, shard, tensor)`` mesh: tensor
  parallel (DTensor's ``parallelize_module``) over neighbouring ranks, FSDP2
  over ``shard`` and replicas over the rest (:mod:`agents.state.mesh_layout`).

A *slice* is what one rank of a replica of ``shards`` ranks holds: for every
parameter (and every optimizer state tensor shaped like it) its local tensor;
for ``fsdp`` and ``hsdp`` the rows of chunk ``index`` of dimension 0, chunked as
``torch.chunk`` (and FSDP2) does.

Past the 450 lines a module is looked at: :class:`ShardedModel` builds each
generation's module and captures and fills its slices, one class whose parts
read best together; its pieces that stand alone live beside it (layout,
tensor plan, pipeline, timing).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from agents.state.mesh_layout import (
    Layout,
    MeshShape,
    build_mesh,
    check_hsdp_world,
    chunk_rows,
    layout_of,
)
from agents.state.pipeline import Pipeline, PipelineRunner, split_stages, stage_of
from agents.state.replica_barrier import ReplicaBarrier
from agents.state.sharded_timing import CollectiveTiming, time_collectives
from agents.state.tensor_plan import TensorPlan, apply_plan, check_plan, default_plan
from agents.state.tracked_optimizers import repoint_optimizer

__all__ = [
    "PARAM",
    "SHARDING_MODES",
    "DataShare",
    "Layout",
    "MeshShape",
    "ShardedModel",
    "Slice",
    "SliceKey",
    "build_mesh",
    "check_hsdp_world",
    "check_mode",
    "chunk_rows",
    "layout_of",
    "redundancy_ignored",
]

#: The values of ``sharding=`` (``mesh`` is what ``wrap(mesh=...)`` makes).
SHARDING_MODES = ("ddp", "fsdp", "hsdp", "mesh")

#: Key of a parameter's own rows in a slice (``(fqn, PARAM)``).
PARAM = "param"

SliceKey = tuple[str, str]


def check_mode(sharding: str) -> str:
    """``sharding`` when it is one of :data:`SHARDING_MODES`.

    Raises:
        ValueError: naming the valid modes.
    """
    if sharding not in SHARDING_MODES:
        raise ValueError(
            f"sharding={sharding!r} is not a sharding mode; use one of "
            + ", ".join(repr(m) for m in SHARDING_MODES)
        )
    return sharding


def redundancy_ignored(mode: str, every_steps: int, default: int) -> str | None:
    """A warning when the job file sets ``fault_tolerance.redundancy`` for a model
    that makes no buddy copies (``ddp``, ``hsdp``), else None.

    ``every_steps`` equal to ``default`` is taken as not set.
    """
    if mode == "fsdp" or every_steps == default:
        return None
    has = "every rank" if mode == "ddp" else "its twin in another replica"
    return (
        f"fault_tolerance.redundancy.every_steps ({every_steps}) is ignored: a "
        f"sharding={mode!r} model keeps no buddy copies (each slice is also held by {has})"
    )


@dataclass
class Slice:
    """One rank's slice of a sharded model and its optimizers, at ``step``.

    Attributes:
        tensors: ``(fqn, PARAM)`` → the parameter's rows; ``(fqn, "<opt>.<key>")``
            → the rows of a sharded optimizer state tensor of optimizer ``<opt>``.
        replicated: what every rank of the generation holds alike: optimizer
            hyperparameters and scalar state, the model's buffers, the other
            tracked objects, the RNG (None for a buddy's copy, which needs none).
    """

    step: int
    layout: Layout
    tensors: dict[SliceKey, torch.Tensor]
    replicated: dict[str, Any] | None = None

    def structure(self) -> dict[SliceKey, tuple[torch.dtype, tuple[int, ...]]]:
        """Each tensor's dtype and trailing shape (what a receiver allocates)."""
        return {k: (t.dtype, tuple(t.shape[1:])) for k, t in self.tensors.items()}

    def copy_to_host(self) -> Slice:
        """A copy in host memory that later training steps cannot change."""
        tensors = {k: t.detach().to("cpu", copy=True) for k, t in self.tensors.items()}
        return Slice(self.step, self.layout, tensors, copy.deepcopy(self.replicated))


class DataShare:
    """A sharded model's share of the data, as an ``ElasticLoader`` placement
    (:class:`~agents.runtime.data.Placement`) read at each step from two callables:
    the share a rank reads where it is not its rank (tensor-parallel ranks and
    pipeline stages of one replica read the same share)."""

    def __init__(self, rank: Callable[[], int], world_size: Callable[[], int]) -> None:
        self._rank = rank
        self._world_size = world_size

    @property
    def rank(self) -> int:
        return self._rank()

    @property
    def world_size(self) -> int:
        return self._world_size()


def _meta_copy(module: nn.Module) -> nn.Module:
    """``module``'s structure with every parameter and buffer on the meta device."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


@dataclass
class _Generation:
    mesh: DeviceMesh
    layout: Layout
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


class ShardedModel(nn.Module):
    """Forward to a ``fully_shard``-ed copy of the module, rebuilt per generation.

    Build it with :meth:`agents.runtime.Session.wrap`; create optimizers on its
    :meth:`parameters` as usual.  ``state_dict()`` is the sharded module's
    (DTensors), as ``get_model_state_dict`` returns it.
    """

    _blueprint: nn.Module
    _gen: _Generation | None
    _next: tuple[nn.Module, _Generation] | None

    def __init__(
        self,
        module: nn.Module,
        mode: str,
        shard_size: int | None = None,
        mesh: MeshShape | None = None,
        tensor_plan: TensorPlan | None = None,
        pipeline: Pipeline | None = None,
    ) -> None:
        super().__init__()
        if check_mode(mode) == "ddp":
            raise ValueError("ShardedModel shards; use ElasticDDP for sharding='ddp'")
        if shard_size is not None and shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {shard_size}")
        if (mode == "mesh") != (mesh is not None):
            raise ValueError("a mesh= goes with mode 'mesh' and no other")
        plan: TensorPlan = {}
        if mesh is not None and mesh.tensor > 1:
            plan = default_plan(module) if tensor_plan is None else tensor_plan
            check_plan(module, plan, mesh.tensor)
        stages = mesh.pipeline if mesh is not None else 1
        if (stages > 1) != (pipeline is not None):
            raise ValueError(
                'a mesh with "pipeline" > 1 takes pipeline=Pipeline(loss_fn=...), and only it'
            )
        #: the children of the model each pipeline stage holds (one stage: all)
        self.stages = [[n for n, _ in module.named_children()]]
        self.runner: PipelineRunner | None = None
        if pipeline is not None:
            pipeline.check(stages)
            self.stages = split_stages(module, stages, pipeline.split)
            self.runner = PipelineRunner(pipeline, stages)
        #: a replica's ranks apply an optimizer step together (``hsdp``, ``mesh``)
        self.barrier = ReplicaBarrier()
        #: the worker's step timing, fed by each generation's FSDP2 collectives
        #: (:mod:`agents.state.sharded_timing`); None: not timed
        self.timing: CollectiveTiming | None = None
        #: ``wrap(mesh=...)``'s shape, None for ``fsdp``/``hsdp``
        self.mesh_shape = mesh
        self.tensor_plan = plan
        if mesh is not None:
            shard_size = mesh.replica_size
        for name, p in module.named_parameters():
            if p.dim() == 0:
                raise ValueError(f"parameter {name} is a scalar; fully_shard shards dimension 0")
        self.mode = mode
        self.shard_size = shard_size
        self.module = module
        #: the parameters' full row counts, by name
        self.rows = {n: p.shape[0] for n, p in module.named_parameters()}
        #: the parameters of the module the optimizers currently point at, by name
        self.params: dict[str, nn.Parameter] = dict(module.named_parameters())
        #: the module as the script built it, until the first generation took its values
        self.initial: nn.Module | None = module
        object.__setattr__(self, "_blueprint", _meta_copy(module))
        object.__setattr__(self, "_gen", None)
        object.__setattr__(self, "_next", None)

    # -- per generation ----------------------------------------------------------------

    @property
    def layout(self) -> Layout | None:
        return self._gen.layout if self._gen is not None else None

    @property
    def device_mesh(self) -> DeviceMesh:
        """The generation's mesh (its dimensions named ``replicate``, ``shard``, ``tensor``)."""
        if self._gen is None:
            raise RuntimeError("no mesh outside a generation: ask inside session.steps()")
        return self._gen.mesh

    @property
    def data_rank(self) -> int:
        """Which share of each step's batch this rank reads: the tensor-parallel ranks
        and pipeline stages of one replica's shard read the same; the others their own."""
        mesh, shape = self.device_mesh, self.mesh_shape
        if shape is None:
            return mesh.get_rank()
        at = dict(zip(mesh.mesh_dim_names or (), mesh.get_coordinate() or (), strict=True))
        return at["replicate"] * shape.shard + at["shard"]

    @property
    def data_world_size(self) -> int:
        """How many shares each step's batch is dealt into (replicas x shard)."""
        shape = self.mesh_shape
        if shape is None:
            return self.device_mesh.size()
        return self.device_mesh.size() // (shape.pipeline * shape.tensor)

    @property
    def data(self) -> DataShare:
        """This rank's share of the data, as an ``ElasticLoader`` placement."""
        return DataShare(lambda: self.data_rank, lambda: self.data_world_size)

    def build_mesh(self, world_size: int, shard_size: int, device_type: str) -> DeviceMesh:
        """The mesh of a generation of ``world_size`` ranks."""
        return build_mesh(self.mode, world_size, shard_size, device_type, self.mesh_shape)

    @property
    def building(self) -> _Generation:
        """The generation :meth:`build` made and :meth:`adopt` has not yet switched to."""
        assert self._next is not None, "build() first"
        return self._next[1]

    def build(self, mesh: DeviceMesh, layout: Layout, device: torch.device) -> nn.Module:
        """A fresh sharded module on ``mesh`` with uninitialised slices (not yet in use)."""
        if self.mode != "fsdp":  # one replica of fsdp is every rank: buddies' snapshots serve
            self.barrier.form(mesh.get_rank(), mesh.size(), layout.shards)
        fresh = copy.deepcopy(self._blueprint)
        sharded_over = mesh
        if self.mesh_shape is None:
            fully_shard(fresh, mesh=mesh)
        else:
            if self.runner is not None:  # this rank's stage: its children, under their names
                fresh = stage_of(fresh, self.stages[self.mesh_shape.stage(layout)])
            names = dict(fresh.named_modules())
            plan = {k: v for k, v in self.tensor_plan.items() if k in names}
            if plan:
                apply_plan(fresh, mesh["tensor"], plan)
            sharded_over = mesh["replicate", "shard"]
            fully_shard(fresh, mesh=sharded_over)
        if self.timing is not None:  # FSDP2's collectives feed the step timing
            sizes = sharded_over.shape  # (shard,) or (replicate, shard)
            replicas = sizes[0] if len(sizes) == 2 else 1
            time_collectives(fresh, self.timing, shards=sizes[-1], replicas=replicas)
        fresh.to_empty(device=device)
        gen = _Generation(mesh, layout, dict(fresh.named_parameters()), device)
        for name, p in gen.params.items():
            if self.mesh_shape is not None:
                break  # a mesh's local tensors are DTensor's to lay out
            local = p.to_local() if isinstance(p, DTensor) else p
            start, stop = chunk_rows(self.rows[name], layout)
            if local.shape[0] != stop - start:
                raise RuntimeError(
                    f"{name}: FSDP holds {local.shape[0]} rows here, ringmaster expected "
                    f"{stop - start} (chunk {layout.index} of {layout.shards}); "
                    "this torch shards differently"
                )
        object.__setattr__(self, "_next", (fresh, gen))
        return fresh

    def fill_from(self, full: Mapping[str, torch.Tensor], module: nn.Module) -> None:
        """Fill the local slices of ``module`` (being built) from whole tensors
        (every rank has the same ones: no collective)."""
        for name, p in self.building.params.items():
            local = self.local_rows(name, module)
            if isinstance(p, DTensor):
                piece = distribute_tensor(
                    full[name].detach().to(local.device),
                    p.device_mesh,
                    p.placements,
                    src_data_rank=None,
                )
                local.copy_(piece.to_local())
            else:
                local.copy_(full[name].detach())

    def local_rows(self, name: str, module: nn.Module | None = None) -> torch.Tensor:
        """The local rows of parameter ``name`` of the module being built (or in use)."""
        params = self.building.params if module is not None else self.params
        p = params[name]
        # detached: a view that shares the storage FSDP holds, writable in place
        return (p.to_local() if isinstance(p, DTensor) else p).detach()

    def adopt(self, optimizers: dict[str, torch.optim.Optimizer], states: dict[str, Any]) -> None:
        """Switch to the module made by :meth:`build`; point ``optimizers`` at it.

        Args:
            states: per optimizer name, ``{fqn: {key: tensor}}`` for the new params
                (local rows of sharded entries, scalars as they are).
        """
        assert self._next is not None, "build() first"
        fresh, gen = self._next
        object.__setattr__(self, "_next", None)
        for name, opt in optimizers.items():
            repoint_optimizer(opt, self.params, gen.params, states.get(name, {}))
        self.module = fresh
        self.params = gen.params
        self.initial = None
        object.__setattr__(self, "_gen", gen)
        self.barrier.attach(optimizers)
        if self.runner is not None:
            self.runner.reset(fresh, gen.mesh, gen.device)

    def rank_stages(self) -> tuple[int, ...] | None:
        """Per rank of the generation, the pipeline stage it holds (None: no pipeline)."""
        shape, gen = self.mesh_shape, self._gen
        if self.runner is None or shape is None or gen is None:
            return None
        size = shape.replica_size
        return tuple(shape.stage(Layout(size, r % size)) for r in range(gen.mesh.size()))

    def step(self, inputs: torch.Tensor, target: torch.Tensor, train: bool = True) -> torch.Tensor:
        """A pipelined model's forward and backward of one step (every rank calls it
        with the step's batch; ``train=False``: forward only); the loss, on every rank."""
        if self.runner is None:
            raise RuntimeError("model.step() runs a pipeline; call the model and backward()")
        return self.runner.step(inputs, target, train)

    def drop(self) -> None:
        """Forget gradients of a failed step (the module stays until the next build)."""
        for p in self.params.values():
            p.grad = None

    # -- slices ------------------------------------------------------------------------

    def capture(
        self, step: int, optimizers: dict[str, torch.optim.Optimizer], others: dict[str, Any]
    ) -> Slice:
        """This rank's live slice (tensors not copied) with the replicated state."""
        gen = self._gen
        assert gen is not None, "no generation built yet"
        tensors: dict[SliceKey, torch.Tensor] = {}
        scalars: dict[str, dict[str, dict[str, Any]]] = {}
        groups: dict[str, list[dict[str, Any]]] = {}
        for name in gen.params:
            tensors[(name, PARAM)] = self.local_rows(name)
        for oname, opt in optimizers.items():
            fqn_of = {id(p): n for n, p in gen.params.items()}
            groups[oname] = [
                {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
            ]
            scalars[oname] = {}
            for p, st in opt.state.items():
                fqn = fqn_of[id(p)]
                for key, value in st.items():
                    if isinstance(value, DTensor):
                        tensors[(fqn, f"{oname}.{key}")] = value.to_local().detach()
                    else:
                        scalars[oname].setdefault(fqn, {})[key] = value
        replicated = {
            "groups": groups,
            "scalars": scalars,
            "buffers": dict(self.module.named_buffers()),
            "objects": {n: o.state_dict() for n, o in others.items()},
            "rng": torch.get_rng_state(),
        }
        return Slice(step, gen.layout, tensors, replicated)

    # -- forwarding --------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._gen is None:
            raise RuntimeError("ShardedModel used outside a training step (no process group yet)")
        if self.runner is not None:
            raise RuntimeError("a pipelined model runs through model.step(inputs, target)")
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state, strict=strict, assign=assign)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return iter(list(self.params.values()))

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for n, p in self.params.items():
            yield (f"{prefix}.{n}" if prefix else n), p

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on the CPU (a collective: call it on every rank)."""
        out = {}
        for n, p in self.params.items():
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            out[n] = whole.detach().to("cpu", copy=True)
        return out

    def local_parameters(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        """This rank's rows of each parameter: ``(start, stop, rows)`` (no collective;
        ``fsdp`` and ``hsdp``: a mesh's slices are not rows, see :meth:`full_parameters`)."""
        gen = self._gen
        assert gen is not None, "no generation built yet"
        if self.mesh_shape is not None:
            raise RuntimeError("a mesh's slices are not rows of dimension 0: use full_parameters()")
        return {
            n: (*chunk_rows(self.rows[n], gen.layout), self.local_rows(n).detach().clone())
            for n in gen.params
        }
