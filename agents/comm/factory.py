"""Map the job spec's ``comm`` section to a registered-ready DDP comm hook.

:func:`build_comm_hook` is the one entry point of the worker runtime: it
validates the combination, creates the hierarchy process groups when asked
(a collective call: every rank must call it, in the same order relative to
other group creations), and returns a :class:`~agents.comm.api.CommHook`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from agents.comm.api import CommConfigError, CommHook, Compressor, NodeLayout
from agents.comm.builtin import HalfPrecisionHook, LocalSGDHook, PowerSGDHook
from agents.comm.gradient_hook import GradientHook
from agents.comm.hierarchical import HierarchyGroups, build_groups
from agents.comm.qsgd import QSGDCompressor
from agents.comm.safety import SafetyPolicy
from agents.comm.topk import TopKCompressor
from orchestrator.spec.job import CommSpec, CompressionKind


def build_comm_hook(
    comm: CommSpec,
    model: torch.nn.Module,
    layout: NodeLayout | None = None,
    process_group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> CommHook:
    """Build the comm hook the spec asks for.

    Args:
        comm: the job's ``comm`` section.
        model: the DDP model (or its module); parameter names key hook state.
        layout: node of every rank; needed for ``hierarchical`` and used by
            local SGD for intra-node averaging.  Default: from
            ``LOCAL_WORLD_SIZE`` in the environment.
        process_group: the group DDP reduces over (default: the world).
        seed: seed of the hook's random generators (same on every rank).

    Returns:
        A hook; call ``register(ddp_model)`` before the first forward pass.

    Raises:
        CommConfigError: the combination cannot run (e.g. PowerSGD with
            ``hierarchical``: :meth:`CommSpec.problems`; uneven nodes for the
            hierarchical all-reduce).
    """
    problems = comm.problems() + comm.compression.problems()
    if problems:
        raise CommConfigError("; ".join(f"comm.{p}: {m}" for p, m in problems))
    c = comm.compression
    kind = CompressionKind(c.type)
    world = dist.get_world_size(process_group)
    needs_layout = comm.hierarchical or kind == CompressionKind.LOCALSGD
    groups: HierarchyGroups | None = None
    if needs_layout:
        if process_group is not None and process_group is not dist.group.WORLD:
            raise CommConfigError("hierarchical groups are built on the default process group")
        groups = build_groups(layout or NodeLayout.from_env(world))

    if kind == CompressionKind.FP16:
        return HalfPrecisionHook(torch.float16, process_group)
    if kind == CompressionKind.BF16:
        return HalfPrecisionHook(torch.bfloat16, process_group)
    if kind == CompressionKind.POWERSGD:
        if c.start_iter < 2:
            raise CommConfigError(
                f"comm.compression.start_iter: PowerSGD needs at least 2 (DDP rebuilds its "
                f"buckets after the first iteration), got {c.start_iter}"
            )
        return PowerSGDHook(
            model,
            rank=c.rank,
            start_iter=c.start_iter,
            min_compression_rate=c.min_compression_rate,
            warm_start=c.warm_start,
            process_group=process_group,
            seed=seed,
        )
    if kind == CompressionKind.LOCALSGD:
        intra = groups.intra if groups is not None else None
        return LocalSGDHook(c.period, c.start_iter, intra, process_group)

    compressor: Compressor | None = None
    policy = SafetyPolicy()
    if kind == CompressionKind.TOPK:
        compressor = TopKCompressor(c.ratio, c.momentum, c.warmup_steps)
        # Top-k's own schedule ramps density; the safety warm-up sends the first steps dense.
        policy = SafetyPolicy(warmup_steps=0, dense_sync_every=c.dense_sync_every)
    elif kind == CompressionKind.QSGD:
        compressor = QSGDCompressor(c.bits)
        policy = SafetyPolicy(warmup_steps=c.warmup_steps, dense_sync_every=c.dense_sync_every)
    return GradientHook(
        model,
        compressor,
        policy,
        groups=groups if comm.hierarchical else None,
        inter_node_only=c.inter_node_only,
        process_group=process_group,
        seed=seed,
    )
