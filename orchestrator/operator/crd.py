"""The ``TrainingJob`` CustomResourceDefinition, generated from the job spec dataclasses.

The CRD's ``spec`` schema is derived from :class:`orchestrator.spec.job.JobSpec`
field by field (:mod:`orchestrator.operator.crd_schema`), so a job file and a
TrainingJob ``spec`` are the same format and cannot drift apart; this module
adds the status schema, the printer columns and the CRD around them.
``k8s/crd.yaml`` is this module's output (``python -m orchestrator.operator.crd
> k8s/crd.yaml``); a test checks that the committed file is up to date.

What openAPI cannot say is written as CEL rules (``x-kubernetes-validations``,
checked by the API server), ``spec.name`` equal to ``metadata.name`` among
them.  The operator runs the full spec
loader (:func:`orchestrator.spec.loader.load_job_data`) on every spec as well,
so a rule the schema misses is still caught, with the loader's message.

Differences from a job file, forced by Kubernetes' structural schemas:

* ``entrypoint`` must be a mapping (the string shorthand cannot be typed);
* durations are integer seconds or strings with a unit (``"500ms"``, ``"5m"``);
* ``name`` is optional and defaults to ``metadata.name``;
* compression parameters have no schema default (the loader rejects
  parameters of other compression kinds, and a schema default would add them).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from orchestrator.api import JobPhase
from orchestrator.operator.api import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from orchestrator.operator.crd_schema import spec_schema
from orchestrator.operator.status import INVALID_PHASE, SUSPENDED_PHASE

__all__ = ["crd_manifest", "printer_columns", "render_crd_yaml", "status_schema"]

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
        "# Generated by `python -m orchestrator.operator.crd` from orchestrator/spec/job.py.\n"
        "# Do not edit by hand: change the dataclasses and regenerate.\n"
    )
    return head + yaml.dump(crd_manifest(), Dumper=_NoAliasDumper, sort_keys=False, width=100)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared sub-schemas out in full: anchors would make the file harder to read."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(render_crd_yaml())
