"""The job spec: one dataclass tree, loaded from YAML by :mod:`orchestrator.spec.loader`.

The tree is the single description of a job: the CLI, the controller, the
agents and the Kubernetes operator all read it, and the CRD schema is
generated from its field names and defaults (:mod:`orchestrator.operator.crd`).

Every dataclass has a ``problems()`` method returning the cross-field problems it sees on
its own (``nodes.min`` larger than ``nodes.max``...) as ``(relative path, message)`` pairs,
so a loader reports all of them at once with their YAML lines.  ``JobSpec.validate()``
raises :class:`~orchestrator.spec.api.SpecError` with every problem for specs built in code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any

from orchestrator.spec.api import SpecError, SpecProblem
from orchestrator.spec.bounds import (
    INT64_MAX,
    MAX_NODES,
    MAX_NPROC_PER_NODE,
    Problems,
    positive_duration,
    too_large,
)
from orchestrator.spec.checkpoint import CheckpointSpec
from orchestrator.spec.comm import (  # noqa: F401  (part of the spec's names)
    COMPRESSION_PARAMS,
    FLAT_ONLY_COMPRESSION,
    Backend,
    CommSpec,
    CompressionKind,
    CompressionSpec,
)
from orchestrator.spec.dataclass_tree import nested_problems, plain
from orchestrator.spec.slurm import SlurmSpec
from orchestrator.spec.sync import (  # noqa: F401  (part of the spec's names)
    OuterOptimizerName,
    OuterOptimizerSpec,
    OuterQuantization,
    SyncMode,
    SyncSpec,
)

#: Job names become etcd keys, paths and Kubernetes object names: DNS-1123 labels.
JOB_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")


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
            out += positive_duration(getattr(self, name), name)
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


class RecoveryMode(str, Enum):
    """How the job recovers from a failure (``fault_tolerance.recovery``).

    ``in_process``: the script uses the ringmaster runtime (``runtime.init()``);
    survivors keep their memory and a replacement gets its state from a live
    peer.  ``restart``: any torchrun script; on a failure every worker of the
    new generation is started again (from a pre-imported standby) with
    torchrun's environment, and the script resumes from its own checkpoint.
    ``auto`` is resolved when the job is validated or submitted by reading the
    entrypoint (:func:`orchestrator.spec.entrypoint.resolve_recovery`).
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


class StragglerAction(str, Enum):
    """What the controller does about a node that keeps stepping slower than its peers."""

    SWAP = "swap"  # report, and a warm spare takes its slot at a step boundary
    REPORT = "report"  # a Straggler event, a metric, a mark in status
    OFF = "off"  # steps are not timed, nothing is judged


@dataclass
class StragglerSpec:
    """How slow nodes are told from their peers (``fault_tolerance.stragglers``).

    A node is a straggler when its compute time per step stays at or above
    ``threshold`` times the median of its peers' for ``windows`` windows in a row
    (a window: one heartbeat interval with steps in it).  ``swap`` puts a warm
    spare in its slot once the straggler has cost the job ``confirm`` (its peers'
    time spent waiting for it, summed from its first slow window) and when the
    swap gains ``min_gain`` over its cost
    (:mod:`orchestrator.controller.straggler_swaps`).
    """

    action: StragglerAction = StragglerAction.REPORT
    #: how many times the peers' median compute time a straggler's is (more than 1)
    threshold: float = 1.2
    #: consecutive windows above ``threshold`` before a node is called a straggler (5: a
    #: burst of noise on one node, a CPU hog or a GC pause storm, is not called, and a
    #: node 1.5x as slow is still called in about 11 s at a 2 s heartbeat)
    windows: int = 5
    #: ``swap``: by how much the time the swap saves over the rest of the job must beat
    #: what the swap costs (the job's last recovery, else 2 s) for a spare to take over
    min_gain: timedelta = timedelta(seconds=10)
    #: ``swap``: what a straggler must already have cost the job (its compute time over
    #: its peers' median, summed over its steps since its first slow window) before a
    #: spare takes its slot; a burst of contention is over long before that
    confirm: timedelta = timedelta(seconds=5)

    def problems(self) -> Problems:
        out: Problems = []
        if self.confirm.total_seconds() < 0:
            out.append(("confirm", f"must be 0 or more, got {self.confirm.total_seconds():g}s"))
        if self.min_gain.total_seconds() < 0:
            out.append(("min_gain", f"must be 0 or more, got {self.min_gain.total_seconds():g}s"))
        if not (self.threshold > 1.0 and self.threshold <= 100.0):
            out.append(("threshold", f"must be above 1 and at most 100, got {self.threshold}"))
        if not 1 <= self.windows <= 1000:
            out.append(("windows", f"must be 1 to 1000, got {self.windows}"))
        return out


@dataclass
class FaultToleranceSpec:
    """How failures are detected and how often the job may recover.

    ``max_restarts``: restarts after an error in the training script (a lost node
    is replaced without limit while nodes are left).  ``hang_timeout``: the longest
    a collective waits for a hung or cut-off peer (the learnt collective timeout's
    ceiling is twice this; it serves before steps were timed and during saves); a
    worker whose heartbeats stop is called hung by the heartbeat rule instead
    (:mod:`orchestrator.controller.hangs`).
    """

    max_restarts: int = 3
    recovery: RecoveryMode = RecoveryMode.AUTO
    hang_timeout: timedelta = timedelta(seconds=300)
    heartbeat_interval: timedelta = timedelta(seconds=2)
    preemption_grace: timedelta = timedelta(seconds=30)
    redundancy: RedundancySpec = field(default_factory=RedundancySpec)
    stragglers: StragglerSpec = field(default_factory=StragglerSpec)

    def problems(self) -> Problems:
        out: Problems = []
        if self.max_restarts < 0:
            out.append(("max_restarts", f"must be 0 or more, got {self.max_restarts}"))
        for name in ("hang_timeout", "heartbeat_interval", "preemption_grace"):
            out += positive_duration(getattr(self, name), name)
        if self.heartbeat_interval >= self.hang_timeout:
            out.append(
                (
                    "heartbeat_interval",
                    f"heartbeat_interval ({self.heartbeat_interval.total_seconds():g}s) must be "
                    f"shorter than hang_timeout ({self.hang_timeout.total_seconds():g}s)",
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


#: Settings only the ringmaster runtime acts on, and what a restart-tier script does instead.
RUNTIME_ONLY = {
    "max_steps": "the script counts its own steps",
    **{
        f"checkpoint.{k}": "the script saves its own checkpoints, in RINGMASTER_CHECKPOINT_DIR"
        for k in (
            "every_steps",
            "every_seconds",
            "keep",
            "async",
            "max_consecutive_failures",
            "final_wait",
        )
    },
    **{
        f"comm.{k}": "the script builds its own DDP and process group"
        for k in (
            "compression",
            "hierarchical",
            "bucket_cap_mb",
            "op_timeout_floor",
            "op_timeout_multiple",
        )
    },
    "fault_tolerance.hang_timeout": "its collectives' timeouts are the script's own",
    "fault_tolerance.redundancy": "the script's model is not the runtime's to copy",
    "fault_tolerance.stragglers": "the script reports no step times to tell stragglers by",
}


def restart_tier_refusal(why: str, tier: str = "fault_tolerance.recovery 'restart'") -> str:
    """Why a setting of :data:`RUNTIME_ONLY` is refused to a job of the restart tier."""
    return (
        f"only the ringmaster runtime acts on it, and {tier} runs a script that does not "
        f"use it ({why}): remove it, or use a script that calls runtime.init()"
    )


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
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
    sync: SyncSpec = field(default_factory=SyncSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    slurm: SlurmSpec = field(default_factory=SlurmSpec)  # read only by `ringmaster slurm`

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
        if self.sync.delayed and self.fault_tolerance.recovery is RecoveryMode.RESTART:
            out.append(
                (
                    "sync.mode",
                    f"{self.sync.mode.value} runs in the ringmaster runtime; "
                    "fault_tolerance.recovery: restart runs scripts that do not use it (use "
                    "in_process or auto with a script that calls runtime.init())",
                )
            )
        if self.sync.delayed and (
            self.comm.hierarchical or self.comm.compression.type is CompressionKind.LOCALSGD
        ):
            out.append(
                (
                    "sync.mode",
                    f"{self.sync.mode.value} averages inside each site with DDP; "
                    "comm.hierarchical and comm.compression.type: localsgd build groups over every "
                    "rank: turn them off (fp16, bf16, powersgd, topk and qsgd work inside a site)",
                )
            )
        return out

    def runtime_settings(self) -> Problems:
        """The settings given here that only the ringmaster runtime acts on (``(path,
        why)``): a script of the restart tier, which does not use it, would never see
        them.  Refused where a job file is read to run it
        (:func:`orchestrator.spec.entrypoint.resolve_recovery`), not by :meth:`problems`:
        a spec stored before that rule still loads (``sync`` is refused on its own)."""
        given, default = (
            _flat(self.to_dict()),
            _flat(JobSpec(name=self.name, entrypoint=self.entrypoint).to_dict()),
        )
        out: Problems = []
        for prefix, why in RUNTIME_ONLY.items():
            if any(
                (k == prefix or k.startswith(prefix + ".")) and given.get(k) != default.get(k)
                for k in given.keys() | default.keys()
            ):
                out.append((prefix, why))
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
