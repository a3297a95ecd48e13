"""Contracts of the gradient communication layer: layouts, compressors, hook state, errors.

The worker runtime wraps the model in DDP and registers one comm hook built
from the job spec's ``comm`` section (:func:`agents.comm.factory.build_comm_hook`).
Implementations live in sibling modules: :mod:`.hierarchical` (intra-node /
inter-node all-reduce), :mod:`.topk` and :mod:`.qsgd` (compressors),
:mod:`.compressed` (error feedback, safety and metrics around a compressor),
:mod:`.builtin` (torch's fp16/bf16/PowerSGD/post-local-SGD hooks) and
:mod:`.factory`.  This module imports none of them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

# --------------------------------------------------------------------------- errors


class CommError(Exception):
    """Base of every error raised by ``agents.comm``."""


class CommConfigError(CommError):
    """The comm section cannot be applied to this job (layout, group sizes...)."""


class HookStateError(CommError):
    """Saved hook state does not fit the hook it is loaded into."""


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class NodeLayout:
    """Which node each global rank runs on, in rank order.

    Ranks of one node need not be contiguous, though the topology order
    makes them so.  The hierarchical all-reduce needs every node to run the
    same number of ranks.

    Attributes:
        node_of_rank: ``node_of_rank[r]`` is the node index of global rank ``r``.
    """

    node_of_rank: tuple[int, ...]

    @classmethod
    def uniform(cls, world_size: int, local_world_size: int) -> NodeLayout:
        """``world_size`` ranks, ``local_world_size`` per node, nodes contiguous."""
        if local_world_size < 1 or world_size % local_world_size:
            raise CommConfigError(
                f"world size {world_size} is not a multiple of the local world size "
                f"{local_world_size}"
            )
        return cls(tuple(r // local_world_size for r in range(world_size)))

    @classmethod
    def from_node_ranks(cls, node_ranks: Iterable[int]) -> NodeLayout:
        """From each rank's node index, e.g. a topology order's slots::

        NodeLayout.from_node_ranks(s.node_rank for s in order.slots)
        """
        return cls(tuple(int(n) for n in node_ranks))

    @classmethod
    def from_env(cls, world_size: int, env: Mapping[str, str] | None = None) -> NodeLayout:
        """From torchrun's ``LOCAL_WORLD_SIZE`` (uniform nodes, contiguous ranks)."""
        source = os.environ if env is None else env
        return cls.uniform(world_size, int(source.get("LOCAL_WORLD_SIZE", "1")))

    @property
    def world_size(self) -> int:
        return len(self.node_of_rank)

    @property
    def nodes(self) -> list[list[int]]:
        """Global ranks of each node, node index ascending, ranks ascending."""
        out: dict[int, list[int]] = {}
        for rank, node in enumerate(self.node_of_rank):
            out.setdefault(node, []).append(rank)
        return [out[k] for k in sorted(out)]

    @property
    def local_world_size(self) -> int:
        """Ranks per node.

        Raises:
            CommConfigError: nodes run different numbers of ranks.
        """
        sizes = {len(n) for n in self.nodes}
        if len(sizes) != 1:
            raise CommConfigError(
                f"nodes run different numbers of ranks ({sorted(sizes)}); the hierarchical "
                "all-reduce needs the same number on every node"
            )
        return sizes.pop()

    def peers_by_local_rank(self) -> list[list[int]]:
        """For each local rank ``i``: the ``i``-th rank of every node (the inter-node groups)."""
        nodes = self.nodes
        return [[node[i] for node in nodes] for i in range(self.local_world_size)]

    def local_rank_of(self, rank: int) -> int:
        return self.nodes[self.node_of_rank[rank]].index(rank)


# --------------------------------------------------------------------------- metrics


@dataclass
class StepMetrics:
    """What one training step's gradient exchange cost, summed over buckets.

    Attributes:
        step: hook iteration the figures belong to.
        numel: gradient elements exchanged.
        wire_bytes: bytes this rank put into collectives (values, indices,
            scales, status words; both stages of a hierarchical exchange).
        compressed_buckets: buckets sent compressed.
        dense_buckets: buckets sent dense (warm-up, periodic sync, fallback).
        fallbacks: buckets that fell back to dense for non-finite or exploding
            gradients.
        cosine: sampled cosine similarity between the local corrected
            gradient and what its compressed form decodes to (``None`` when
            not sampled this step).
    """

    step: int = 0
    numel: int = 0
    wire_bytes: int = 0
    compressed_buckets: int = 0
    dense_buckets: int = 0
    fallbacks: int = 0
    cosine: float | None = None

    @property
    def ratio_vs_fp32(self) -> float:
        """Dense fp32 bytes over bytes sent (higher is better)."""
        return (4 * self.numel) / self.wire_bytes if self.wire_bytes else 1.0

    @property
    def ratio_vs_fp16(self) -> float:
        """Dense fp16 bytes over bytes sent."""
        return (2 * self.numel) / self.wire_bytes if self.wire_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio_vs_fp32"] = round(self.ratio_vs_fp32, 3)
        out["ratio_vs_fp16"] = round(self.ratio_vs_fp16, 3)
        return out


@dataclass
class CommMetrics:
    """Per-step metrics of a hook; ``last`` is the newest complete step.

    Attributes:
        last: the last completed step's figures (``None`` before the first).
        current: the step being accumulated.
        total_wire_bytes: bytes sent since the hook was built.
    """

    last: StepMetrics | None = None
    current: StepMetrics = field(default_factory=StepMetrics)
    total_wire_bytes: int = 0

    def add(self, numel: int, wire_bytes: int, compressed: bool, fallback: bool = False) -> None:
        self.current.numel += numel
        self.current.wire_bytes += wire_bytes
        self.total_wire_bytes += wire_bytes
        if compressed:
            self.current.compressed_buckets += 1
        else:
            self.current.dense_buckets += 1
        if fallback:
            self.current.fallbacks += 1

    def add_bytes(self, wire_bytes: int) -> None:
        """Bytes of a stage that is not a bucket of its own (intra-node stages)."""
        self.current.wire_bytes += wire_bytes
        self.total_wire_bytes += wire_bytes

    def end_step(self, next_step: int) -> None:
        self.last = self.current
        self.current = StepMetrics(step=next_step)


# --------------------------------------------------------------------------- protocols


@dataclass
class Encoded:
    """A compressor's output for one tensor, before anyone has agreed to use it.

    Attributes:
        payload: 1-D tensor sent to every peer; same dtype and length on all ranks.
        corrected: the error-corrected tensor that was compressed (what a dense
            fallback sends instead).
        commit: new values of the compressor's buffers if the payload is used.
        flush: new values of the buffers if ``corrected`` is sent dense instead.
    """

    payload: torch.Tensor
    corrected: torch.Tensor
    commit: dict[str, torch.Tensor]
    flush: dict[str, torch.Tensor]


class Compressor(Protocol):
    """Lossy encoding of a gradient chunk, exchanged by all-gather.

    A compressor is stateless itself; its per-element state (error feedback,
    momentum) lives in buffers named by ``buffer_names`` and owned by the
    hook, so it can be saved, restored and re-bucketed.
    """

    #: names of the per-element float32 buffers the compressor needs
    buffer_names: tuple[str, ...]
    #: dtype of the payload
    payload_dtype: torch.dtype

    def active(self, step: int, numel: int, world_size: int) -> bool:
        """Whether compressing ``numel`` elements at ``step`` beats a dense all-reduce."""
        ...

    def encode(
        self,
        grad: torch.Tensor,
        buffers: Mapping[str, torch.Tensor],
        step: int,
        generator: torch.Generator,
    ) -> Encoded:
        """Compress ``grad`` (1-D float32) with error feedback from ``buffers`` (not mutated)."""
        ...

    def dense(
        self, grad: torch.Tensor, buffers: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """What to all-reduce dense in place of compression, and the buffers after it."""
        ...

    def decode_sum(self, gathered: torch.Tensor, numel: int, step: int) -> torch.Tensor:
        """Sum of the decoded payloads; ``gathered`` is ``[world, payload_len]``."""
        ...


class HookState(Protocol):
    """Per-rank hook state that travels with checkpoints."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class CommHook(Protocol):
    """What the worker runtime holds after :func:`agents.comm.factory.build_comm_hook`.

    Usage::

        hook = build_comm_hook(spec.comm, ddp_model, layout=layout)
        hook.register(ddp_model)          # before the first forward
        ...
        loss.backward(); optimizer.step()
        hook.after_optimizer_step(ddp_model)
        checkpoint["comm_hook"] = hook.state_dict()   # per rank
    """

    metrics: CommMetrics
    step: int

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None: ...

    def after_optimizer_step(self, model: torch.nn.Module) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
