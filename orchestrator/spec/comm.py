"""The job spec's ``comm`` section: how gradients travel between the ranks.

Part of the job spec's dataclass tree (:mod:`orchestrator.spec.job`, which
re-exports these names): the collective backend, hierarchical all-reduce, the
topology labels ranks follow, bucket sizes, collective timeouts and gradient
compression with the parameters of each kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum

from orchestrator.spec.bounds import Problems, positive_duration

__all__ = [
    "COMPRESSION_PARAMS",
    "FLAT_ONLY_COMPRESSION",
    "Backend",
    "CommSpec",
    "CompressionKind",
    "CompressionSpec",
]


class CompressionKind(str, Enum):
    """Gradient compression applied by the DDP comm hook."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    POWERSGD = "powersgd"
    TOPK = "topk"
    QSGD = "qsgd"
    LOCALSGD = "localsgd"


#: Parameters that apply to each compression kind (besides ``type``).
COMPRESSION_PARAMS: dict[CompressionKind, tuple[str, ...]] = {
    CompressionKind.NONE: (),
    CompressionKind.FP16: (),
    CompressionKind.BF16: (),
    CompressionKind.POWERSGD: ("rank", "start_iter", "min_compression_rate", "warm_start"),
    CompressionKind.TOPK: ("ratio", "momentum", "warmup_steps", "dense_sync_every"),
    CompressionKind.QSGD: ("bits", "warmup_steps", "dense_sync_every"),
    CompressionKind.LOCALSGD: ("period", "start_iter"),
}


@dataclass
class CompressionSpec:
    """Which compression and its parameters; parameters of other kinds are rejected."""

    type: CompressionKind = CompressionKind.NONE
    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    warm_start: bool = True
    ratio: float = 0.01
    momentum: float = 0.9
    warmup_steps: int = 100
    dense_sync_every: int = 0
    bits: int = 8
    period: int = 4
    #: compress only the inter-node stage of the hierarchical all-reduce
    inter_node_only: bool = False

    def problems(self) -> Problems:
        out: Problems = []
        if self.rank < 1:
            out.append(("rank", f"must be at least 1, got {self.rank}"))
        if self.start_iter < 0:
            out.append(("start_iter", f"must be 0 or more, got {self.start_iter}"))
        if not 0.0 < self.ratio <= 1.0:
            out.append(("ratio", f"must be in (0, 1], got {self.ratio:g}"))
        if not 0.0 <= self.momentum < 1.0:
            out.append(("momentum", f"must be in [0, 1), got {self.momentum:g}"))
        if self.warmup_steps < 0:
            out.append(("warmup_steps", f"must be 0 or more, got {self.warmup_steps}"))
        if self.dense_sync_every < 0:
            out.append(
                ("dense_sync_every", f"must be 0 (off) or more, got {self.dense_sync_every}")
            )
        if self.bits not in (4, 8):
            out.append(("bits", f"must be 4 or 8, got {self.bits}"))
        if self.period < 1:
            out.append(("period", f"must be at least 1, got {self.period}"))
        return out


#: Compression kinds that are torch's own DDP hooks: no hierarchical form.
FLAT_ONLY_COMPRESSION = frozenset({"fp16", "bf16", "powersgd", "localsgd"})


class Backend(str, Enum):
    """The data plane's collective backend (``comm.backend``).

    ``auto``: NCCL when the worker sees a CUDA device, else gloo.  The step
    boundary's control vector always travels on a small gloo group beside it.
    """

    AUTO = "auto"
    NCCL = "nccl"
    GLOO = "gloo"


@dataclass
class CommSpec:
    """How gradients travel: backend, compression, hierarchical all-reduce, topology
    labels, and how long a collective may take before a peer counts as gone.

    A collective's timeout is ``op_timeout_multiple`` times the slowest step of the
    recent past, never under ``op_timeout_floor`` and never over twice
    ``fault_tolerance.hang_timeout``.
    """

    backend: Backend = Backend.AUTO
    compression: CompressionSpec = field(default_factory=CompressionSpec)
    hierarchical: bool = False
    topology_labels: list[str] = field(default_factory=lambda: ["zone", "rack", "host"])
    bucket_cap_mb: float = 25.0
    op_timeout_floor: timedelta = timedelta(seconds=5)
    op_timeout_multiple: float = 10.0

    def problems(self) -> Problems:
        out: Problems = []
        out += positive_duration(self.op_timeout_floor, "op_timeout_floor")
        if self.op_timeout_multiple < 2:
            out.append(
                (
                    "op_timeout_multiple",
                    f"must be 2 or more (a collective may wait for a peer's whole step), "
                    f"got {self.op_timeout_multiple:g}",
                )
            )
        if len(set(self.topology_labels)) != len(self.topology_labels):
            out.append(("topology_labels", f"labels repeat: {self.topology_labels}"))
        if self.bucket_cap_mb <= 0:
            out.append(("bucket_cap_mb", f"must be positive, got {self.bucket_cap_mb:g}"))
        kind = self.compression.type
        if self.hierarchical and kind.value in FLAT_ONLY_COMPRESSION:
            out.append(
                (
                    "compression.type",
                    f"'{kind.value}' has no hierarchical form (it is one of torch's own "
                    "hooks); use none, topk or qsgd with 'comm.hierarchical: true', or set "
                    "hierarchical to false",
                )
            )
        if self.compression.inter_node_only and not self.hierarchical:
            out.append(
                (
                    "compression.inter_node_only",
                    "needs 'comm.hierarchical: true' (there is no inter-node stage without it)",
                )
            )
        return out
