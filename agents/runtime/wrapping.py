"""What ``session.wrap`` builds: a DDP that survives generations, or a sharded model.

Runs in the training process.  :class:`WrappedModels` holds what a session's
script wrapped (the session's :class:`~agents.state.api.Holdings`: which kind
of state it is, for the join's recovery), drops and rebuilds it with each
generation, and makes the step participants it needs
(:mod:`agents.runtime.participants`: a delayed sync's outer loop, the buddy
copies' snapshots).
:func:`wrap_ddp` checks the options of ``sharding="ddp"`` and builds an
:class:`~agents.runtime.elastic_ddp.ElasticDDP`; :func:`wrap_sharded` checks
those of ``fsdp`` and ``hsdp`` and builds a
:class:`~agents.state.sharding.ShardedModel` (with its buddy copies for
``fsdp`` with redundancy); :func:`install_spec_hook` registers the job file's
comm hook (compression, hierarchical all-reduce) on each generation's DDP.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agents.runtime.elastic_ddp import ElasticDDP, HookInstaller
from agents.runtime.failures import CollectiveFailures
from agents.runtime.outer_checkpoint import OUTER_STATE
from agents.runtime.participants import BuddySnapshots, DelayedSync, StepParticipant
from agents.state.api import REPLICAS, SITE_SLICES, SITES, SLICES
from agents.state.buddy_copies import BuddyCopies
from agents.state.mesh_layout import MeshShape, mesh_shape
from agents.state.pipeline import Pipeline
from agents.state.sharding import (
    ShardedModel,
    check_mode,
    redundancy_ignored,
)
from agents.sync.outer_sync import OuterSync
from orchestrator.spec.job import DEFAULT_REDUNDANCY_EVERY_STEPS, CommSpec, JobSpec
from orchestrator.state.records import Plan

__all__ = [
    "WrappedModels",
    "check_delayed",
    "check_delayed_sharded",
    "install_spec_hook",
    "mode_of",
    "uses_spec_hook",
    "wrap_ddp",
    "wrap_sharded",
]

log = logging.getLogger("ringmaster.worker")


class WrappedModels:
    """What a session's script wrapped: DDPs, or one sharded model and its buddy copies.

    Args:
        spec: the job's spec (``comm``, ``fault_tolerance.redundancy``).
        device: the worker's device.
        failures: records a failed collective of the DDPs' comm hooks; its step
            timing is fed by the DDPs' hooks and a sharded model's collectives.
        spec_hook: installs the job file's comm hook on a DDP, for a ``ddp``
            wrap without a hook of the script's own when the job file asks for one.
    """

    def __init__(
        self,
        spec: JobSpec,
        device: torch.device,
        failures: CollectiveFailures,
        spec_hook: HookInstaller,
    ) -> None:
        self._spec = spec
        self._device = device
        self._failures = failures
        self._spec_hook = spec_hook
        self.ddps: list[ElasticDDP] = []
        #: a DDP of the script's own comm hook (it may let the replicas drift apart)
        self._script_hook = False
        #: the sharded model (``sharding="fsdp"|"hsdp"``), if any
        self.sharded: ShardedModel | None = None
        #: ``fsdp`` with redundancy: this rank's snapshots and its ward's copy
        self.buddies: BuddyCopies | None = None
        #: a delayed sync (``sync.mode`` diloco, streaming_diloco): the outer loop
        self.outer: OuterSync | None = None
        #: the kind of state wrapped (:mod:`agents.state.api`): the key of its recovery
        self.kind = REPLICAS
        #: what takes part in the step loop, in the order the session calls them
        self.participants: list[StepParticipant] = []

    def wrap(
        self,
        module: nn.Module,
        hook_installer: HookInstaller | None,
        sharding: str | None,
        shard_size: int | None,
        redundancy_every_steps: int | None,
        mesh: Mapping[str, int] | None = None,
        tensor_plan: Mapping[str, Any] | None = None,
        pipeline: Pipeline | None = None,
    ) -> ElasticDDP | ShardedModel:
        """See :meth:`agents.runtime.Session.wrap`."""
        sharding = mode_of(sharding, mesh, tensor_plan)
        if pipeline is not None and not isinstance(pipeline, Pipeline):
            raise ValueError(
                "pipeline= takes agents.runtime.Pipeline(loss_fn=...), not "
                + type(pipeline).__name__
            )
        if pipeline is not None and mesh is None:
            raise ValueError('pipeline= goes with mesh={"pipeline": P, ...}; pass a mesh')
        ignored = redundancy_ignored(
            check_mode(sharding),
            self._spec.fault_tolerance.redundancy.every_steps,
            DEFAULT_REDUNDANCY_EVERY_STEPS,
        )
        if ignored is not None:
            log.warning("%s", ignored)
        if self._spec.sync.delayed:
            if sharding != "ddp":
                check_delayed_sharded(self._spec, sharding)
            check_delayed(self._spec, self.outer is not None)  # one model, DDP or FSDP2
        if sharding != "ddp":
            self.sharded, self.buddies = wrap_sharded(
                module,
                sharding,
                shard_size,
                redundancy_every_steps,
                hook_installer,
                spec=self._spec,
                device=self._device,
                has_sharded=self.sharded is not None,
                mesh=mesh_shape(mesh) if mesh is not None else None,
                tensor_plan=tensor_plan,
                pipeline=pipeline,
            )
            sharded = self.sharded
            sharded.timing = self._failures.timing  # its collectives time its steps
            self.kind = SLICES
            if self._spec.sync.delayed:  # FSDP2 in each site: each rank syncs its own slice
                names = list(sharded.rows)  # buddy copies pair inside each site
                self.outer = OuterSync(
                    self._spec.sync,
                    list(sharded.params.values()),
                    local=lambda: [sharded.local_rows(n) for n in names],
                )
                self.kind = SITE_SLICES
                self.participants.append(DelayedSync(self.outer, self._failures))
            if self.buddies is not None:
                self.participants.append(BuddySnapshots(self.buddies, sharded))
            return sharded
        if uses_spec_hook(self._spec.comm):
            if hook_installer is not None:
                raise ValueError(
                    "wrap(hook_installer=...) installs the script's own DDP comm hook, and the "
                    "job file's comm.compression / comm.hierarchical would install another: "
                    "DDP takes one, so remove one of them"
                )
            hook_installer = self._spec_hook
        else:
            self._script_hook = self._script_hook or hook_installer is not None
        wrapped = wrap_ddp(
            module,
            hook_installer,
            shard_size=shard_size,
            redundancy_every_steps=redundancy_every_steps,
            spec=self._spec,
            device=self._device,
            failures=self._failures,
        )
        self.ddps.append(wrapped)
        if self._spec.sync.delayed:
            self.outer = OuterSync(self._spec.sync, list(wrapped.module.parameters()))
            self.kind = SITES
            self.participants.append(DelayedSync(self.outer, self._failures))
        if dist.is_initialized():
            wrapped.rebuild(self._data_group())
        return wrapped

    def replica(self) -> nn.Module | None:
        """The one DDP model every rank at one step holds alike, with the same optimizer
        state: its gradients are averaged at every step (not post-local SGD, nor a comm
        hook of the script's own, which may let the replicas differ).  None otherwise."""
        local_sgd = self._spec.comm.compression.type.value == "localsgd"
        alike = len(self.ddps) == 1 and not self._script_hook and not local_sgd
        return self.ddps[0].module if alike else None

    def check_tracked(self, names: Iterable[str]) -> None:
        """Refuse a script's object tracked under the name the delayed sync's outer
        state is tracked by (it would replace that state in checkpoints and state syncs).

        Raises:
            ValueError: ``outer`` under ``sync.mode`` diloco or streaming_diloco.
        """
        if self._spec.sync.delayed and OUTER_STATE in names:
            raise ValueError(
                f"track(): under sync.mode {self._spec.sync.mode.value} the name "
                f"{OUTER_STATE!r} holds the outer state (anchors, outer momentum); "
                "track your object under another name"
            )

    def rebuild(self) -> None:
        """Build the DDPs on the generation just joined (the sharded model is built there)."""
        for w in self.ddps:
            w.rebuild(self._data_group())

    def _data_group(self) -> dist.ProcessGroup | None:
        """The group a DDP averages over: its site's under a delayed sync, else every rank."""
        groups = self.outer.groups if self.outer is not None else None
        return groups.inner if groups is not None else None

    def drop(self, *, gradients: bool = True) -> None:
        """Let go of the generation's DDPs (the group is going).

        Args:
            gradients: also forget the sharded model's gradients (a failed step's).
        """
        for w in self.ddps:
            w.drop()
        if gradients and self.sharded is not None:
            self.sharded.drop()


def mode_of(
    sharding: str | None, mesh: Mapping[str, int] | None, tensor_plan: Mapping[str, Any] | None
) -> str:
    """The sharding mode ``wrap()``'s arguments ask for (``mesh`` when a mesh is given).

    Raises:
        ValueError: both ``sharding`` and ``mesh``, or a ``tensor_plan`` without a mesh.
    """
    if mesh is not None:
        if sharding is not None:
            raise ValueError(
                f"wrap() takes sharding= or mesh=, not both: mesh= lays out replicas, shards "
                f"and tensor parallel itself; remove sharding={sharding!r}"
            )
        return "mesh"
    if tensor_plan is not None:
        raise ValueError('tensor_plan= goes with mesh={"tensor": T, ...}; pass a mesh')
    return check_mode(sharding or "ddp")


def check_delayed(spec: JobSpec, wrapped_before: bool) -> None:
    """A delayed sync (``sync.mode`` diloco, streaming_diloco) syncs one model per job.

    Raises:
        ValueError: a second model.
    """
    mode = spec.sync.mode.value
    if wrapped_before:
        raise ValueError(
            f"sync.mode {mode} syncs one model per job and this session wrapped one already: "
            "put the models in one nn.Module and wrap that once, or use sync.mode: ddp"
        )


def check_delayed_sharded(spec: JobSpec, sharding: str) -> None:
    """A delayed sync shards a model with ``fsdp`` in each site, and only so.

    Raises:
        ValueError: ``hsdp`` or a mesh.
    """
    mode = spec.sync.mode.value
    if sharding != "fsdp":
        raise ValueError(
            f"sync.mode {mode} trains a DDP or an FSDP2 model in each site; wrap it with "
            f"sharding='ddp' or sharding='fsdp' (not {sharding!r}), or use sync.mode: ddp"
        )


def uses_spec_hook(comm: CommSpec) -> bool:
    """The job file asks for a comm hook of its own (compression or hierarchical)."""
    return comm.hierarchical or comm.compression.type.value != "none"


def wrap_ddp(
    module: nn.Module,
    hook_installer: HookInstaller | None,
    *,
    shard_size: int | None,
    redundancy_every_steps: int | None,
    spec: JobSpec,
    device: torch.device,
    failures: CollectiveFailures,
) -> ElasticDDP:
    """``module`` as an :class:`ElasticDDP` (on ``device``'s GPU, if it is one).

    Raises:
        ValueError: an option of another mode was given.
    """
    if shard_size is not None:
        raise ValueError("shard_size is an option of sharding='hsdp'")
    if redundancy_every_steps is not None:
        raise ValueError("redundancy_every_steps is an option of sharding='fsdp'")
    placement: dict[str, Any] = {}
    if device.type == "cuda":
        module = module.to(device)
        placement["device_ids"] = [device.index]
    return ElasticDDP(
        module,
        hook_installer=hook_installer,
        failures=failures,
        bucket_cap_mb=spec.comm.bucket_cap_mb,
        **placement,
    )


def wrap_sharded(
    module: nn.Module,
    sharding: str,
    shard_size: int | None,
    every_steps: int | None,
    hook_installer: HookInstaller | None,
    *,
    spec: JobSpec,
    device: torch.device,
    has_sharded: bool,
    mesh: MeshShape | None = None,
    tensor_plan: Mapping[str, Any] | None = None,
    pipeline: Pipeline | None = None,
) -> tuple[ShardedModel, BuddyCopies | None]:
    """``module`` as a :class:`ShardedModel`, and its buddy copies (``fsdp`` with redundancy).

    Args:
        has_sharded: the session already wrapped a sharded model.

    Raises:
        ValueError: an option of another mode, a comm hook, a second sharded
            model, or a wrap after the first generation was joined.
    """
    if every_steps is not None and sharding != "fsdp":
        raise ValueError(
            f"redundancy_every_steps is an option of sharding='fsdp'; {sharding!r} keeps "
            "each slice in its twin of another replica group"
        )
    if every_steps is not None and every_steps < 0:
        raise ValueError(f"redundancy_every_steps must be 0 (off) or more, got {every_steps}")
    if hook_installer is not None:
        raise ValueError(f"a DDP comm hook cannot be installed with sharding={sharding!r}")
    if shard_size is not None and sharding != "hsdp":
        raise ValueError(f"shard_size is an option of sharding='hsdp', not {sharding!r}")
    if has_sharded:
        raise ValueError("this session already has a sharded model; wrap one model per job")
    if dist.is_initialized():
        raise ValueError(f"wrap(sharding={sharding!r}) before the first session.steps()")
    if uses_spec_hook(spec.comm):
        raise ValueError(
            f"comm.compression and comm.hierarchical are DDP comm hooks; sharding={sharding!r} "
            "reduce-scatters gradients itself: remove them from the job file"
        )
    if device.type == "cuda":
        module = module.to(device)
    if mesh is None and sharding == "mesh":
        raise ValueError("sharding='mesh' is what wrap(mesh=...) makes: pass mesh= instead")
    if tensor_plan is not None and (mesh is None or mesh.tensor == 1):
        raise ValueError('tensor_plan= splits layers over mesh "tensor"; that dimension is 1')
    wrapped = ShardedModel(module, sharding, shard_size, mesh, tensor_plan, pipeline)
    buddies = None
    if sharding == "fsdp":
        every = spec.fault_tolerance.redundancy.every_steps
        if every_steps is not None:  # the script's own choice wins over the job file
            every = every_steps
        buddies = BuddyCopies(every) if every > 0 else None
    return wrapped, buddies


def install_spec_hook(
    comm: CommSpec, ddp: Any, plan: Plan | None, resumed: dict[str, Any] | None
) -> Any:
    """Register the job's comm hook on a DDP built for ``plan``'s generation; returns the hook.

    Args:
        comm: the job file's ``comm`` section.
        ddp: the generation's ``DistributedDataParallel``.
        plan: the generation (its nodes give the hierarchical layout).
        resumed: hook state restored from a durable checkpoint at the same world
            size, or None.
    """
    from agents.comm import NodeLayout, build_comm_hook

    assert plan is not None
    node_of_rank = [i for i, m in enumerate(plan.members) for _ in range(m.nproc)]
    layout = NodeLayout.from_node_ranks(node_of_rank)
    group = ddp.process_group  # the world's, or a site's under a delayed sync
    hook = build_comm_hook(comm, ddp, layout=layout, process_group=group, seed=0)
    # Every rank starts the generation with a fresh hook: a replacement has no
    # hook state, and ranks whose warm-up counters differ would run different
    # collectives.  Error-feedback residuals of the old generation are dropped;
    # after a durable resume at the same world size, every rank loads its own.
    if resumed is not None:
        from agents.comm.api import HookStateError

        try:
            hook.load_state_dict(resumed)
        except HookStateError as e:  # resumed with --force under another compression
            log.warning("%s: the comm hook starts fresh", e)
            hook = build_comm_hook(comm, ddp, layout=layout, process_group=group, seed=0)
    hook.register(ddp)
    return hook
