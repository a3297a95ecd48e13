"""The ``TrainingJob`` CustomResourceDefinition, generated from the job spec dataclasses.

The CRD's ``spec`` schema is derived from :class:`orchestrator.spec.JobSpec`
field by field: the YAML key names (``async``, not ``async_``), the types and
the defaults all come from the dataclasses, so a job file and a TrainingJob
``spec`` are the same format and cannot drift apart.  ``k8s/crd.yaml`` is this
module's output (``python -m orchestrator.operator.crd > k8s/crd.yaml``); a
test checks that the committed file is up to date.

What openAPI cannot say is written as CEL rules (``x-kubernetes-validations``,
checked by the API server): ``nodes.min <= nodes.max``, exactly one of
``entrypoint.script`` / ``entrypoint.module``, ``tls.cert`` with ``tls.key``,
``spec.name`` equal to ``metadata.name``.  The operator runs the full spec
loader (:func:`orchestrator.spec_loader.load_job_data`) on every spec as well,
so a rule the schema misses is still caught, with the loader's message.

Differences from a job file, forced by Kubernetes' structural schemas:

* ``entrypoint`` must be a mapping (the string shorthand cannot be typed);
* durations are integer seconds or strings with a unit (``"500ms"``, ``"5m"``);
* ``name`` is optional and defaults to ``metadata.name``;
* compression parameters have no schema default (the loader rejects
  parameters of other compression kinds, and a schema default would add them).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from datetime import timedelta
from enum import Enum
from typing import Any

import yaml

from orchestrator.api import JobPhase
from orchestrator.operator.api import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from orchestrator.operator.status import INVALID_PHASE, SUSPENDED_PHASE
from orchestrator.operator.trainingjob import FREE_FORM, TrainingJobFields
from orchestrator.spec import JobSpec, camel_key

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
    "rendezvous.tls": "TLS for the job's own etcd (file paths inside the image or a mount).",
    "rendezvous.tls.ca_cert": "CA certificate that signed etcd's server certificate.",
    "rendezvous.tls.cert": "Client certificate (with key).",
    "rendezvous.tls.key": "Client private key (with cert).",
    "rendezvous.user": "etcd user name (the operator's RINGMASTER_ETCD_USER when unset).",
    "rendezvous.password_env": "Environment variable that holds the etcd password.",
    "fault_tolerance.max_restarts": "How many recoveries the job may make before it fails.",
    "fault_tolerance.hang_timeout": "A worker with no progress for this long counts as hung.",
    "fault_tolerance.heartbeat_interval": "How often workers report progress.",
    "fault_tolerance.redundancy": (
        "In-memory copies of a sharded (fsdp) model's slices on a buddy node."
    ),
    "fault_tolerance.redundancy.every_steps": (
        "Every this many steps each rank copies its slice to its buddy; 0 turns copies off."
    ),
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
    "comm.compression.warmup_steps": "top-k / QSGD: dense steps before compressing.",
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
    "fault_tolerance.max_restarts": 0,
    "comm.compression.rank": 1,
    "comm.compression.start_iter": 0,
    "comm.compression.warmup_steps": 0,
    "comm.compression.dense_sync_every": 0,
    "comm.compression.period": 1,
    "resources.gpus": 0,
}

#: CEL rules by dotted YAML path ("" is the spec itself).
RULES: dict[str, list[dict[str, str]]] = {
    "nodes": [
        {
            "rule": "self.min <= self.max",
            "message": "nodes.min must not be larger than nodes.max",
        }
    ],
    "entrypoint": [
        {
            "rule": "has(self.script) != has(self.module)",
            "message": "give exactly one of 'script' (a path) or 'module' (python -m name)",
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


#: Descriptions of the status fields (``kubectl explain trainingjob.status.<field>``).
STATUS_DESCRIPTIONS: dict[str, str] = {
    "step": "Highest step completed by every rank.",
    "worldSize": "Ranks training now (nodes times nprocPerNode).",
    "generation": "The controller's plan number; one more per membership change.",
    "activePods": "Agent pods that train now, in rank order.",
    "sparePods": "Agent pods registered as warm spares.",
    "failedPods": "Agent pods the controller declared failed.",
    "activeCount": "Number of activePods.",
    "spareCount": "Number of sparePods.",
    "desiredPods": "Agent pods the job wants: nodes.max plus nodes.spares (0 when suspended "
    "or finished).",
    "readyPods": "Agent pods whose agent is registered (Ready).",
    "replacedPods": "Failed agent pods the operator replaced so far.",
    "nextPodIndex": "Index the next new agent pod gets (names are never reused).",
    "recoveries": "Failures the job recovered from.",
    "lastCheckpoint": "The newest committed durable checkpoint.",
    "message": "The controller's last message, or why the spec was rejected.",
    "observedGeneration": "metadata.generation of the spec this status is for.",
    "updatedAt": "When the controller last wrote its record.",
    "conditions": "Ready, Recovering, SparesAvailable, Finished, SpecValid, Suspended.",
}


def status_schema() -> dict[str, Any]:
    """The schema of ``TrainingJob.status`` (written by the operator only)."""
    string: dict[str, Any] = {"type": "string"}
    integer: dict[str, Any] = {"type": "integer", "format": "int64"}
    names: dict[str, Any] = {"type": "array", "items": string}
    condition = {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {**string, "description": "Condition type."},
            "status": {
                "type": "string",
                "enum": ["True", "False", "Unknown"],
                "description": "True, False or Unknown.",
            },
            "reason": {**string, "description": "One word: why."},
            "message": {**string, "description": "Details for a person."},
            "lastTransitionTime": {
                "type": "string",
                "format": "date-time",
                "description": "When the status last changed.",
            },
            "observedGeneration": {**integer, "description": "Spec generation it is for."},
        },
    }
    kinds: dict[str, dict[str, Any]] = {
        "step": integer,
        "worldSize": integer,
        "generation": integer,
        "activePods": names,
        "sparePods": names,
        "failedPods": names,
        "activeCount": integer,
        "spareCount": integer,
        "desiredPods": integer,
        "readyPods": integer,
        "replacedPods": integer,
        "nextPodIndex": integer,
        "recoveries": integer,
        "lastCheckpoint": string,
        "message": string,
        "observedGeneration": integer,
        "updatedAt": {"type": "string", "format": "date-time"},
        "conditions": {
            "type": "array",
            "items": condition,
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    }
    properties: dict[str, Any] = {
        "phase": {
            "type": "string",
            "enum": [p.value for p in JobPhase] + [INVALID_PHASE, SUSPENDED_PHASE],
            "description": (
                "Job phase as the controller reports it (Invalid: bad spec; "
                "Suspended: spec.suspend is true)."
            ),
        }
    }
    for key, schema in kinds.items():
        properties[key] = {**schema, "description": STATUS_DESCRIPTIONS[key]}
    properties["completionTime"] = {
        "type": "string",
        "format": "date-time",
        "description": "When the job Succeeded or Failed (ttlSecondsAfterFinished counts from "
        "here).",
    }
    return {
        "type": "object",
        "description": "Observed state, copied from the controller's record in etcd.",
        "properties": properties,
    }


def printer_columns() -> list[dict[str, Any]]:
    """Columns of ``kubectl get trainingjobs``."""
    return [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
        {"name": "World", "type": "integer", "jsonPath": ".status.worldSize"},
        {"name": "Active", "type": "integer", "jsonPath": ".status.activeCount"},
        {"name": "Spares", "type": "integer", "jsonPath": ".status.spareCount"},
        {"name": "Recoveries", "type": "integer", "jsonPath": ".status.recoveries"},
        {
            "name": "Checkpoint",
            "type": "string",
            "jsonPath": ".status.lastCheckpoint",
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd_manifest() -> dict[str, Any]:
    """The full CustomResourceDefinition object."""
    root = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.spec.name) || self.spec.name == self.metadata.name",
                "message": "spec.name must equal metadata.name (or be left out)",
            }
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "ringmaster"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["ringmaster"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    """``crd_manifest()`` as the YAML committed in ``k8s/crd.yaml``."""
    head = (
        "# Generated by `python -m orchestrator.operator.crd` from orchestrator/spec.py.\n"
        "# Do not edit by hand: change the dataclasses and regenerate.\n"
    )
    return head + yaml.dump(crd_manifest(), Dumper=_NoAliasDumper, sort_keys=False, width=100)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared sub-schemas out in full: anchors would make the file harder to read."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


# --------------------------------------------------------------------------- derivation


def _object_schema(cls: type, path: str) -> dict[str, Any]:
    """Keys are camelCase; ``path`` (for the tables above) keeps the job file's keys."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        key = f.metadata.get("key", f.name)
        sub = f"{path}.{key}" if path else key
        props[camel_key(key)] = _field_schema(hints[f.name], f, sub)
        if (
            "doc" in f.metadata
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            required.append(camel_key(key))
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


def _field_schema(tp: Any, f: dataclasses.Field[Any], path: str) -> dict[str, Any]:
    if "schema" in f.metadata:  # a Kubernetes type kept as Kubernetes defines it
        schema = dict(f.metadata["schema"])
    else:
        schema = _type_schema(_strip_optional(tp), path)
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
    default = _default_of(f)
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    keep_default = not path.startswith(NO_DEFAULT_PREFIX) or path in _COMPRESSION_DEFAULTS_KEPT
    if required or f.metadata.get("no_default"):
        pass  # required fields never take a default; nor what is absent unless given
    elif dataclasses.is_dataclass(_strip_optional(tp)):
        # An empty default makes the API server fill in the nested defaults too.
        schema["default"] = {}
    elif default is not None and keep_default:
        schema["default"] = _plain_default(default)
    elif default is not None:
        schema["description"] = f"{schema.get('description', '')} Default: {default!r}.".strip()
    return schema


def _type_schema(tp: Any, path: str) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _object_schema(tp, path)  # type: ignore[arg-type]
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], path + "[]")}
    if origin is dict:
        if args[1] is Any:
            return dict(FREE_FORM)
        return {"type": "object", "additionalProperties": _type_schema(args[1], path + ".*")}
    if tp is timedelta:
        return {
            "x-kubernetes-int-or-string": True,
            "pattern": DURATION_PATTERN,
            "description": "Seconds (integer) or a duration with a unit: 500ms, 30s, 5m, 1h.",
        }
    if isinstance(tp, type) and issubclass(tp, Enum):
        return {"type": "string", "enum": [m.value for m in tp]}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        if path == "comm.compression.bits":
            return {"type": "integer", "enum": [4, 8]}
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        if path in ("resources.cpu", "resources.memory"):
            return {"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}
        return {"type": "string"}
    raise TypeError(f"no schema for field type {tp!r} at {path}")


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0]
    return tp


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _plain_default(value: Any) -> Any:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        return int(seconds) if seconds == int(seconds) else f"{seconds:g}s"
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [_plain_default(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain_default(v) for k, v in value.items()}
    return value


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(render_crd_yaml())
