"""The openAPI schema of ``TrainingJob.spec``, derived from the job spec dataclasses.

The schema is derived from :class:`orchestrator.spec.job.JobSpec` and
:class:`orchestrator.operator.trainingjob.TrainingJobFields` field by field,
through :mod:`orchestrator.spec.dataclass_tree`: the YAML key names (``async``,
not ``async_``, in camelCase), the types and the defaults all come from the
dataclasses, so a job file and a TrainingJob ``spec`` are the same format and
cannot drift apart.  The tables below add what the dataclasses do not say:
descriptions, lower and upper bounds (the upper ones from
:mod:`orchestrator.spec.bounds`), and CEL rules (``x-kubernetes-validations``,
checked by the API server) for what openAPI cannot say: ``nodes.min <=
nodes.max``, ``nodes.max + nodes.spares`` within bounds, exactly one of
``entrypoint.script`` / ``entrypoint.module``, ``tls.cert`` with ``tls.key``.
:mod:`orchestrator.operator.crd` puts it in the CustomResourceDefinition.  Pure; runs
in the operator and at build time.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from orchestrator.operator.trainingjob import FREE_FORM, TrainingJobFields
from orchestrator.spec.bounds import INT64_MAX, MAX_NODES, MAX_NPROC_PER_NODE, REASONS
from orchestrator.spec.dataclass_tree import FieldInfo, Shape, fields_of, plain
from orchestrator.spec.job import JobSpec
from orchestrator.spec.sync import MAX_FRAGMENTS, MAX_INNER_STEPS

__all__ = ["DESCRIPTIONS", "MAXIMUMS", "MINIMUMS", "RULES", "spec_schema"]

#: Durations: integer seconds, or a number with a unit (what the spec loader accepts).
DURATION_PATTERN = r"^\s*\d+(\.\d+)?\s*(ms|s|m|h)?\s*$"
#: Kubernetes quantities as the job spec accepts them.
QUANTITY_PATTERN = r"^\d+(\.\d+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$"

#: Descriptions of the fields, by dotted YAML path.
DESCRIPTIONS: dict[str, str] = {
    "name": "Job name; defaults to metadata.name and must equal it when given.",
    "entrypoint": "What each worker runs: a script path or a module (python -m), like torchrun.",
    "entrypoint.script": "Path of the training script inside the image.",
    "entrypoint.module": "Module run with python -m.",
    "entrypoint.args": "Arguments passed to the script or module.",
    "entrypoint.env": "Environment variables for the workers.",
    "nodes": "How many nodes train (elastic between min and max) and how many wait warm.",
    "nodes.min": "Fewest nodes the job trains on.",
    "nodes.max": "Most nodes the job trains on; one agent pod per node.",
    "nodes.spares": "Warm spare pods that take over a failed node at once.",
    "nproc_per_node": "Worker processes per node (usually one per GPU).",
    "oversubscribe": (
        "Start nproc_per_node workers even on a node with fewer CPUs (GPUs, for a job on "
        "CUDA: workers share them in turn with comm.backend gloo; NCCL takes one worker "
        "per GPU); without it such a node's agent refuses to register."
    ),
    "max_steps": "Stop after this many steps; 0 means the script decides.",
    "rendezvous": "Where nodes meet; empty endpoints means the operator's etcd.",
    "rendezvous.endpoints": "etcd client endpoints, host:port or http(s)://host:port.",
    "rendezvous.join_timeout": "How long the job may stay below nodes.min before it fails.",
    "rendezvous.last_call_timeout": (
        "Once nodes.min nodes are there, how long to wait for more before training."
    ),
    "checkpoint": "Durable checkpoints: where, how often, how many to keep.",
    "checkpoint.url": "fsspec URL (s3://, gs://, file://, ...) of the checkpoint directory.",
    "checkpoint.async": "Save in the background while training goes on.",
    "checkpoint.every_steps": "Save every this many steps (0: not by steps).",
    "checkpoint.every_seconds": "Save every this many seconds (0: not by time).",
    "checkpoint.keep": "How many committed checkpoints to keep; older ones are deleted.",
    "checkpoint.max_consecutive_failures": (
        "Failed saves in a row (storage faults) that fail the job; 0: never."
    ),
    "checkpoint.final_wait": "How long a job that ended waits for a save still uploading.",
    "rendezvous.tls": "TLS for the job's own etcd (file paths inside the image or a mount).",
    "rendezvous.tls.ca_cert": "CA certificate that signed etcd's server certificate.",
    "rendezvous.tls.cert": "Client certificate (with key).",
    "rendezvous.tls.key": "Client private key (with cert).",
    "rendezvous.user": "etcd user name (the operator's RINGMASTER_ETCD_USER when unset).",
    "rendezvous.password_env": (
        "Environment variable that holds the etcd password: set by the pod template "
        "(e.g. from a Secret) in the job's pods, by the shell of `ringmaster run/submit`."
    ),
    "fault_tolerance.max_restarts": (
        "How many times the workers restart after an error in the training script before "
        "the job fails (a lost node is replaced without limit while nodes are left)."
    ),
    "fault_tolerance.hang_timeout": (
        "The longest a collective waits for a hung or cut-off peer: the learnt collective "
        "timeout never exceeds twice this, and it serves before steps were timed and during "
        "saves. A worker whose heartbeats stop counts as hung after 3 heartbeat intervals."
    ),
    "fault_tolerance.heartbeat_interval": "How often workers report progress.",
    "fault_tolerance.redundancy": (
        "In-memory copies of a sharded (fsdp) model's slices on a buddy node."
    ),
    "fault_tolerance.redundancy.every_steps": (
        "Every this many steps each rank copies its slice to its buddy; 0 turns copies off."
    ),
    "fault_tolerance.stragglers": (
        "Slow nodes: a node whose compute time per step stays above threshold x its "
        "peers' median for windows heartbeat intervals, or whose links the agents "
        "measure slower than the others' when every rank waits longer, is reported."
    ),
    "fault_tolerance.stragglers.action": (
        "swap (a warm spare takes the slot), report (event, metric, status mark) or off."
    ),
    "fault_tolerance.stragglers.min_gain": (
        "swap: time saved over the rest of the job must beat the swap's cost by this."
    ),
    "fault_tolerance.stragglers.confirm": (
        "swap: time a straggler must already have cost the job before a spare takes over."
    ),
    "fault_tolerance.stragglers.threshold": "Slowdown against the peers' median (above 1).",
    "fault_tolerance.stragglers.windows": "Consecutive heartbeat intervals above threshold.",
    "comm.backend": "Collective backend: auto (NCCL where a GPU is seen, else gloo), nccl, gloo.",
    "comm.hierarchical": "All-reduce within each node first, then across nodes.",
    "comm.topology_labels": "Topology labels, outermost first; ranks follow this order.",
    "comm.bucket_cap_mb": "DDP gradient bucket size in MB.",
    "comm.op_timeout_floor": "A collective never times out sooner than this.",
    "comm.op_timeout_multiple": "A collective times out after this many slowest recent steps.",
    "comm.compression.type": "none, fp16, bf16, powersgd, topk, qsgd or localsgd.",
    "comm.compression.inter_node_only": "Compress only the inter-node stage (hierarchical).",
    "comm.compression.rank": "PowerSGD: matrix approximation rank.",
    "comm.compression.start_iter": "PowerSGD / local SGD: plain all-reduce before this step.",
    "comm.compression.min_compression_rate": "PowerSGD: compress only tensors that gain this.",
    "comm.compression.warm_start": "PowerSGD: reuse last step's factors.",
    "comm.compression.ratio": "top-k: share of gradient entries sent.",
    "comm.compression.momentum": "top-k: momentum correction factor.",
    "comm.compression.warmup_steps": (
        "QSGD: dense steps before compressing; top-k: steps over which the fraction sent "
        "falls from 1 to ratio (DGC's warm-up)."
    ),
    "comm.compression.dense_sync_every": "top-k / QSGD: a dense step every N (0: never).",
    "comm.compression.bits": "QSGD: bits per value (4 or 8).",
    "comm.compression.period": "local SGD: average parameters every this many steps.",
    "fault_tolerance": "How failures are detected and how often the job may recover.",
    "fault_tolerance.recovery": (
        "auto: in_process when the entrypoint uses the ringmaster runtime, else restart "
        "(any torchrun script: every worker restarts from the script's own checkpoint)."
    ),
    "fault_tolerance.preemption_grace": (
        "Time a node gets to save before it goes; sets the pods' termination grace period."
    ),
    "comm": "How gradients travel: compression, hierarchical all-reduce, topology labels.",
    "comm.compression": "Gradient compression; parameters of other kinds are rejected.",
    "sync": (
        "When the sites' parameters meet: every step (ddp), every inner_steps steps "
        "(diloco) or in staggered fragments (streaming_diloco)."
    ),
    "sync.mode": "ddp, diloco or streaming_diloco.",
    "sync.inner_steps": "Steps a site trains alone between two syncs of a fragment (H).",
    "sync.fragments": "streaming_diloco: parts of the model synced at staggered steps (F).",
    "sync.delay_steps": "Steps between the start of a sync and the use of its result (tau).",
    "sync.outer_optimizer": "The optimizer applied to the sites' averaged pseudo-gradient.",
    "sync.outer_optimizer.name": "nesterov (SGD with Nesterov momentum) or sgd.",
    "sync.outer_optimizer.lr": "Outer learning rate (0.7 in the DiLoCo paper).",
    "sync.outer_optimizer.momentum": "Outer momentum (0.9 in the DiLoCo paper).",
    "sync.outer_quantization": (
        "How pseudo-gradients travel: none, bf16, 8bit, 4bit (uniform) or e3m0 (4-bit "
        "floats); unset: e3m0 under streaming_diloco, none under diloco (the papers')."
    ),
    "sync.alpha": (
        "Share of a site's own fragment kept when the global one arrives, at least 0 and "
        "below 1; unset: 0.5 under streaming_diloco, 0 under diloco (the papers')."
    ),
    "sync.site_label": "The node label whose value names a node's site (zone by default).",
    "sync.quorum": (
        "The least number of sites an outer sync goes ahead with once sync_timeout has "
        "passed since the first site reached it; unset: every site."
    ),
    "sync.sync_timeout": "How long an outer sync waits for the sites beyond sync.quorum.",
    "resources": "Per-node pod resources.",
    "resources.image": "Container image with ringmaster and the training code.",
    "resources.cpu": "CPU request and limit of each agent pod.",
    "resources.memory": "Memory request and limit of each agent pod.",
    "resources.gpus": "GPUs (nvidia.com/gpu) of each agent pod.",
}

#: Lower bounds that openAPI can check itself, by dotted YAML path.
MINIMUMS: dict[str, int] = {
    "nodes.min": 1,
    "nodes.max": 1,
    "nodes.spares": 0,
    "nproc_per_node": 1,
    "max_steps": 0,
    "checkpoint.every_steps": 0,
    "checkpoint.every_seconds": 0,
    "checkpoint.keep": 1,
    "checkpoint.max_consecutive_failures": 0,
    "fault_tolerance.max_restarts": 0,
    "comm.compression.rank": 1,
    "comm.compression.start_iter": 0,
    "comm.compression.warmup_steps": 0,
    "comm.compression.dense_sync_every": 0,
    "comm.compression.period": 1,
    "sync.inner_steps": 1,
    "sync.fragments": 1,
    "sync.delay_steps": 0,
    "sync.alpha": 0,
    "sync.quorum": 1,
    "resources.gpus": 0,
}

#: Upper bounds, by dotted YAML path: those the job spec checks
#: (:mod:`orchestrator.spec.bounds`, their one source), so the API server refuses
#: what ``ringmaster validate`` refuses.
MAXIMUMS: dict[str, int] = {
    "nproc_per_node": MAX_NPROC_PER_NODE,
    "nodes.min": MAX_NODES,
    "nodes.max": MAX_NODES,
    "nodes.spares": MAX_NODES,
    "max_steps": INT64_MAX,
    "sync.inner_steps": MAX_INNER_STEPS,
    "sync.fragments": MAX_FRAGMENTS,
}

#: CEL rules by dotted YAML path ("" is the spec itself).
RULES: dict[str, list[dict[str, str]]] = {
    "nodes": [
        {
            "rule": "self.min <= self.max",
            "message": "nodes.min must not be larger than nodes.max",
        },
        {
            "rule": f"self.max + self.spares <= {MAX_NODES}",
            "message": f"nodes.max must be at most {MAX_NODES:,} ({REASONS['nodes']})",
        },
    ],
    "entrypoint": [
        {
            "rule": "has(self.script) != has(self.module)",
            "message": "give exactly one of 'script' (a path) or 'module' (python -m name)",
        }
    ],
    "sync": [
        {
            "rule": "!has(self.alpha) || self.alpha < 1.0",
            "message": "sync.alpha must be below 1: at 1 a site never takes the global model",
        }
    ],
    "rendezvous.tls": [
        {
            "rule": "has(self.cert) == has(self.key)",
            "message": "give both 'cert' and 'key' for client-certificate auth, or neither",
        }
    ],
}

#: Fields whose schema gets no default (see the module docstring).
NO_DEFAULT_PREFIX = "comm.compression."
_COMPRESSION_DEFAULTS_KEPT = {"comm.compression.type", "comm.compression.inter_node_only"}


def spec_schema() -> dict[str, Any]:
    """The openAPIV3Schema of ``TrainingJob.spec``: :class:`JobSpec` and
    :class:`~orchestrator.operator.trainingjob.TrainingJobFields`, keys in camelCase."""
    schema = _object_schema(JobSpec, "")
    schema["required"] = ["entrypoint"]
    schema["properties"]["name"]["pattern"] = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
    extra = _object_schema(TrainingJobFields, "")
    clash = set(schema["properties"]) & set(extra["properties"])
    assert not clash, f"TrainingJob fields clash with job spec fields: {clash}"
    schema["properties"].update(extra["properties"])
    return schema


# --------------------------------------------------------------------------- derivation


def _object_schema(cls: type, path: str) -> dict[str, Any]:
    """Keys are camelCase; ``path`` (for the tables above) keeps the job file's keys."""
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in fields_of(cls):
        sub = f"{path}.{f.key}" if path else f.key
        props[f.camel] = _field_schema(f, sub)
        if "doc" in f.metadata and f.required:
            required.append(f.camel)
    out: dict[str, Any] = {"type": "object"}
    doc = DESCRIPTIONS.get(path) if path else "A ringmaster job spec (the job file format)."
    if doc is None and cls.__doc__:
        doc = cls.__doc__.strip().splitlines()[0]
    if doc:
        out["description"] = doc
    out["properties"] = props
    if required:
        out["required"] = required
    if path in RULES:
        out["x-kubernetes-validations"] = RULES[path]
    return out


def _field_schema(f: FieldInfo, path: str) -> dict[str, Any]:
    # a Kubernetes type (metadata "schema") is kept as Kubernetes defines it
    given = f.metadata.get("schema")
    schema = dict(given) if given is not None else _type_schema(f.shape, path)
    if "enum" in f.metadata:  # of a list field: of its items (as the loader checks them)
        target = schema["items"] if schema.get("type") == "array" else schema
        target["enum"] = list(f.metadata["enum"])
    if "minimum" in f.metadata:
        schema["minimum"] = f.metadata["minimum"]
    if "doc" in f.metadata:
        schema["description"] = f.metadata["doc"]
    if path in DESCRIPTIONS and DESCRIPTIONS[path] not in schema.get("description", ""):
        schema["description"] = " ".join(
            d for d in (DESCRIPTIONS[path], schema.get("description")) if d
        )
    if path in MINIMUMS:
        schema["minimum"] = MINIMUMS[path]
    if path in MAXIMUMS:
        schema["maximum"] = MAXIMUMS[path]
    default = f.default()
    keep_default = not path.startswith(NO_DEFAULT_PREFIX) or path in _COMPRESSION_DEFAULTS_KEPT
    if f.required or f.metadata.get("no_default"):
        pass  # required fields never take a default; nor what is absent unless given
    elif f.shape.kind == "dataclass":
        # An empty default makes the API server fill in the nested defaults too.
        schema["default"] = {}
    elif default is not None and keep_default:
        schema["default"] = plain(default, duration=_duration_default)
    elif default is not None:
        schema["description"] = f"{schema.get('description', '')} Default: {default!r}.".strip()
    return schema


def _type_schema(shape: Shape, path: str) -> dict[str, Any]:
    kind = shape.kind
    if kind == "dataclass":
        return _object_schema(shape.type, path)
    if kind == "list":
        return {"type": "array", "items": _type_schema(shape.args[0], path + "[]")}
    if kind == "dict":
        if shape.args[0].kind == "any":
            return dict(FREE_FORM)
        return {"type": "object", "additionalProperties": _type_schema(shape.args[0], path + ".*")}
    if kind == "duration":
        return {
            "x-kubernetes-int-or-string": True,
            "pattern": DURATION_PATTERN,
            "description": "Seconds (integer) or a duration with a unit: 500ms, 30s, 5m, 1h.",
        }
    if kind == "enum":
        return {"type": "string", "enum": [m.value for m in shape.type]}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "int":
        if path == "comm.compression.bits":
            return {"type": "integer", "enum": [4, 8]}
        return {"type": "integer"}
    if kind == "float":
        return {"type": "number"}
    if kind == "str":
        if path in ("resources.cpu", "resources.memory"):
            return {"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}
        return {"type": "string"}
    raise TypeError(f"no schema for field type {shape.type!r} at {path}")


def _duration_default(value: timedelta) -> Any:
    """A duration default as the schema writes it: whole seconds, else with a unit."""
    seconds = value.total_seconds()
    return int(seconds) if seconds == int(seconds) else f"{seconds:g}s"
