"""The job spec: one dataclass tree, loaded from YAML by :mod:`orchestrator.spec_loader`.

The tree is the single description of a job: the CLI, the controller, the
agents and the Kubernetes operator all read it, and the CRD schema is
generated from its field names and defaults (:mod:`orchestrator.operator.crd`).

Every dataclass has a ``problems()`` method returning the cross-field problems it sees on
its own (``nodes.min`` larger than ``nodes.max``...) as ``(relative path, message)`` pairs,
so a loader reports all of them at once with their YAML lines.  ``JobSpec.validate()``
raises :class:`~orchestrator.api.SpecError` with every problem for specs built in code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any

from orchestrator.api import SpecError, SpecProblem
from orchestrator.dataclass_tree import nested_problems, plain
from orchestrator.spec_bounds import INT64_MAX, MAX_NODES, MAX_NPROC_PER_NODE, too_large

Problems = list[tuple[str, str]]

#: Job names become etcd keys, paths and Kubernetes object names: DNS-1123 labels.
JOB_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")

#: URL schemes accepted for durable checkpoints (fsspec protocols).
CHECKPOINT_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "memory")
_SCHEME_LIST = ", ".join(s + "://" for s in CHECKPOINT_SCHEMES)


def _positive(value: timedelta, path: str) -> Problems:
    if value.total_seconds() <= 0:
        return [(path, f"must be a positive duration, got {value.total_seconds():g}s")]
    return []


@dataclass
class EntrypointSpec:
    """What each worker runs: a script path or a module (``python -m``), like torchrun.

    A plain string in the job file is shorthand for ``script``.
    """

    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def problems(self) -> Problems:
        if bool(self.script) == bool(self.module):
            return [("", "give exactly one of 'script' (a path) or 'module' (python -m name)")]
        return []

    def command(self) -> list[str]:
        """The argv after the python interpreter."""
        head = ["-m", self.module] if self.module else [str(self.script)]
        return head + list(self.args)


@dataclass
class NodesSpec:
    """How many nodes train (elastic between min and max) and how many wait warm."""

    min: int = 1
    max: int = 1
    spares: int = 0

    def problems(self) -> Problems:
        out: Problems = []
        if self.min < 1:
            out.append(("min", f"must be at least 1, got {self.min}"))
        if self.spares < 0:
            out.append(("spares", f"must be 0 or more, got {self.spares}"))
        if self.min > self.max:
            out.append(("min", f"nodes.min ({self.min}) is larger than nodes.max ({self.max})"))
        if (total := self.max + max(self.spares, 0)) > MAX_NODES:
            out.append(("max", too_large(total, MAX_NODES, "nodes")))
        return out


@dataclass
class TLSSpec:
    """TLS for the etcd client connection (file paths)."""

    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None

    def problems(self) -> Problems:
        if bool(self.cert) != bool(self.key):
            return [("cert", "give both 'cert' and 'key' for client-certificate auth, or neither")]
        return []


@dataclass
class RendezvousSpec:
    """Where and how nodes meet.  Empty ``endpoints`` means: use an embedded etcd.

    ``join_timeout`` bounds how long the job waits below ``nodes.min`` before it
    fails; ``last_call_timeout`` is how long the controller waits for more nodes
    once ``nodes.min`` is reached.  How fast a dead node or worker is noticed is
    ``fault_tolerance.heartbeat_interval`` and the agents' registration lease
    (``RINGMASTER_NODE_TTL``), not a rendezvous setting.
    """

    endpoints: list[str] = field(default_factory=list)
    join_timeout: timedelta = timedelta(seconds=600)
    last_call_timeout: timedelta = timedelta(seconds=5)
    tls: TLSSpec = field(default_factory=TLSSpec)
    user: str | None = None
    password_env: str | None = None

    def problems(self) -> Problems:
        out: Problems = []
        for name in ("join_timeout", "last_call_timeout"):
            out += _positive(getattr(self, name), name)
        for i, ep in enumerate(self.endpoints):
            if not _ENDPOINT_RE.match(ep):
                out.append(
                    (
                        f"endpoints[{i}]",
                        f"'{ep}' is not an etcd endpoint; use host:port or http(s)://host:port",
                    )
                )
        if self.password_env and not self.user:
            out.append(("password_env", "a password needs a 'user'"))
        return out


_ENDPOINT_RE = re.compile(r"^(https?://)?[A-Za-z0-9.\-\[\]:]+:\d{1,5}\Z", re.ASCII)


@dataclass
class CheckpointSpec:
    """Durable checkpoints: where, how often, how many to keep."""

    url: str = "file://./checkpoints"
    every_steps: int = 0
    every_seconds: float = 0.0
    keep: int = 3
    async_: bool = field(default=True, metadata={"key": "async"})  # the YAML key

    def problems(self) -> Problems:
        out: Problems = []
        scheme = self.url.split("://", 1)[0] if "://" in self.url else "file"
        if scheme not in CHECKPOINT_SCHEMES:
            out.append(
                (
                    "url",
                    f"scheme '{scheme}' is not supported for checkpoints; "
                    f"use one of {_SCHEME_LIST} or a local path",
                )
            )
        elif "://" in self.url and not self.url.split("://", 1)[1].strip("/"):
            out.append(("url", f"'{self.url}' has no bucket or path after the scheme"))
        if self.every_steps < 0:
            out.append(("every_steps", f"must be 0 (off) or more, got {self.every_steps}"))
        if self.every_seconds < 0:
            out.append(("every_seconds", f"must be 0 (off) or more, got {self.every_seconds:g}"))
        if self.keep < 1:
            out.append(("keep", f"must keep at least 1 checkpoint, got {self.keep}"))
        return out


class RecoveryMode(str, Enum):
    """How the job recovers from a failure (``fault_tolerance.recovery``).

    ``in_process``: the script uses the ringmaster runtime (``runtime.init()``);
    survivors keep their memory and a replacement gets its state from a live
    peer.  ``restart``: any torchrun script; on a failure every worker of the
    new generation is started again (from a pre-imported standby) with
    torchrun's environment, and the script resumes from its own checkpoint.
    ``auto`` is resolved when the job is validated or submitted by reading the
    entrypoint (:func:`orchestrator.entrypoint.resolve_recovery`).
    """

    AUTO = "auto"
    IN_PROCESS = "in_process"
    RESTART = "restart"


#: Default of ``fault_tolerance.redundancy.every_steps``: a copy every step cost
#: +22-25 % of the benchmark's step time here (2 shared cores), every 10 steps was
#: within the noise (docs/sharded-models.md), for at most 10 steps trained again
#: after a node loss.
DEFAULT_REDUNDANCY_EVERY_STEPS = 10


@dataclass
class RedundancySpec:
    """In-memory copies of a sharded (``fsdp``) model's slices on a buddy node."""

    #: every this many completed steps each rank copies its slice to its buddy; 0: off
    every_steps: int = DEFAULT_REDUNDANCY_EVERY_STEPS

    def problems(self) -> Problems:
        if self.every_steps < 0:
            return [("every_steps", f"must be 0 (off) or more, got {self.every_steps}")]
        return []


@dataclass
class FaultToleranceSpec:
    """How failures are detected and how often the job may recover."""

    max_restarts: int = 3
    recovery: RecoveryMode = RecoveryMode.AUTO
    hang_timeout: timedelta = timedelta(seconds=300)
    heartbeat_interval: timedelta = timedelta(seconds=2)
    preemption_grace: timedelta = timedelta(seconds=30)
    redundancy: RedundancySpec = field(default_factory=RedundancySpec)

    def problems(self) -> Problems:
        out: Problems = []
        if self.max_restarts < 0:
            out.append(("max_restarts", f"must be 0 or more, got {self.max_restarts}"))
        for name in ("hang_timeout", "heartbeat_interval", "preemption_grace"):
            out += _positive(getattr(self, name), name)
        if self.heartbeat_interval >= self.hang_timeout:
            out.append(
                (
                    "heartbeat_interval",
                    f"heartbeat_interval ({self.heartbeat_interval.total_seconds():g}s) must be "
                    f"shorter than hang_timeout ({self.hang_timeout.total_seconds():g}s)",
                )
            )
        return out


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
        out += _positive(self.op_timeout_floor, "op_timeout_floor")
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


_QUANTITY_RE = re.compile(r"^\d+(\.\d+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?\Z", re.ASCII)


@dataclass
class ResourcesSpec:
    """Per-node resources for Kubernetes pods (Kubernetes quantity strings)."""

    image: str = "ringmaster:latest"
    cpu: str = "1"
    memory: str = "2Gi"
    gpus: int = 0

    def problems(self) -> Problems:
        out: Problems = []
        if not self.image.strip():
            out.append(("image", "must not be empty"))
        for name in ("cpu", "memory"):
            value = getattr(self, name)
            if not _QUANTITY_RE.match(value):
                out.append((name, f"'{value}' is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)"))
        if self.gpus < 0:
            out.append(("gpus", f"must be 0 or more, got {self.gpus}"))
        return out


@dataclass
class JobSpec:
    """A training job.  ``name`` and ``entrypoint`` are the only required fields."""

    name: str
    entrypoint: EntrypointSpec
    nodes: NodesSpec = field(default_factory=NodesSpec)
    nproc_per_node: int = 1
    oversubscribe: bool = False  # more than a node's CPUs or GPUs (agents.node.capacity)
    max_steps: int = 0
    rendezvous: RendezvousSpec = field(default_factory=RendezvousSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    fault_tolerance: FaultToleranceSpec = field(default_factory=FaultToleranceSpec)
    comm: CommSpec = field(default_factory=CommSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)

    def problems(self) -> Problems:
        out: Problems = []
        if not JOB_NAME_RE.match(self.name):
            out.append(
                (
                    "name",
                    f"{self.name!r} is not a valid job name: use 1-63 lowercase letters, digits "
                    "and '-', starting and ending with a letter or digit",
                )
            )
        nproc = self.nproc_per_node
        if nproc < 1:
            out.append(("nproc_per_node", f"must be at least 1, got {nproc}"))
        elif nproc > MAX_NPROC_PER_NODE:
            out.append(("nproc_per_node", too_large(nproc, MAX_NPROC_PER_NODE, "nproc")))
        if self.max_steps < 0:
            out.append(("max_steps", f"must be 0 (unbounded) or more, got {self.max_steps}"))
        elif self.max_steps > INT64_MAX:
            out.append(("max_steps", too_large(self.max_steps, INT64_MAX, "steps")))
        return out

    def all_problems(self) -> Problems:
        """Problems of this spec and every nested section, with full dotted paths."""
        return nested_problems(self)

    def validate(self) -> JobSpec:
        """Raise :class:`SpecError` listing every problem; return self when valid."""
        found = self.all_problems()
        if found:
            raise SpecError([SpecProblem(path, msg) for path, msg in found])
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain data with YAML key names and durations in seconds (round-trips the loader).

        Compression parameters are those of the chosen kind only.
        """
        out: dict[str, Any] = plain(self)
        compression = out["comm"]["compression"]
        keep = {"type", "inter_node_only", *COMPRESSION_PARAMS[self.comm.compression.type]}
        out["comm"]["compression"] = {k: v for k, v in compression.items() if k in keep}
        return out
