"""The TrainingJob CRD: generated from the job spec dataclasses, committed, valid."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from orchestrator.operator.crd import crd_manifest, render_crd_yaml
from orchestrator.operator.crd_schema import MAXIMUMS, spec_schema
from orchestrator.operator.trainingjob import FIELD_KEYS
from orchestrator.spec.bounds import INT64_MAX, MAX_NODES, MAX_NPROC_PER_NODE
from orchestrator.spec.dataclass_tree import camel_key
from orchestrator.spec.job import JobSpec, SpecError
from orchestrator.spec.loader import load_job_data

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "k8s" / "crd.yaml"
K8S_VERSION = "1.37.0"


def _version() -> dict[str, Any]:
    return dict(crd_manifest()["spec"]["versions"][0])


def test_committed_crd_is_the_generated_one() -> None:
    assert CRD_FILE.read_text(encoding="utf-8") == render_crd_yaml(), (
        "k8s/crd.yaml is out of date: run "
        "`.venv/bin/python -m orchestrator.operator.crd > k8s/crd.yaml`"
    )


def test_crd_validates_against_kubernetes_schema() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text(encoding="utf-8"))
    assert kubernetes_validate.validate(crd, K8S_VERSION, strict=True) == "1.37"


def _walk_spec(cls: type, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every key path of the dataclass tree (camelCase), asserting it has a schema node."""
    seen = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = camel_key(f.metadata.get("key", f.name))
        sub = f"{path}.{key}" if path else key
        assert key in schema["properties"], f"{sub} missing from the CRD"
        seen.append(sub)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            seen += _walk_spec(tp, schema["properties"][key], sub)  # type: ignore[arg-type]
    return seen


def test_spec_schema_has_every_field_under_its_camel_case_key() -> None:
    schema = spec_schema()
    paths = _walk_spec(JobSpec, schema)
    assert "checkpoint.async" in paths and "checkpoint.async_" not in paths
    assert "comm.compression.interNodeOnly" in paths
    assert "faultTolerance.preemptionGrace" in paths and "nprocPerNode" in paths
    # and nothing that the dataclasses do not have, besides the TrainingJob's own fields
    assert set(schema["properties"]) == {
        camel_key(f.metadata.get("key", f.name)) for f in dataclasses.fields(JobSpec)
    } | set(FIELD_KEYS)
    assert set(FIELD_KEYS) == {"suspend", "ttlSecondsAfterFinished", "template"}


def _snake_keys_in(node: dict[str, Any], path: str = "") -> list[str]:
    out = []
    for key, sub in (node.get("properties") or {}).items():
        if "_" in key:
            out.append(f"{path}.{key}")
        out += _snake_keys_in(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        out += _snake_keys_in(node["items"], path + "[]")
    return out


def _undescribed(node: dict[str, Any], path: str = "") -> list[str]:
    out = []
    for key, sub in (node.get("properties") or {}).items():
        if not sub.get("description"):
            out.append(f"{path}.{key}")
        out += _undescribed(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        out += _undescribed(node["items"], path + "[]")
    return out


def test_every_field_is_camel_case_and_described_for_kubectl_explain() -> None:
    schema = spec_schema()
    assert _snake_keys_in(schema) == []
    assert _undescribed(schema) == []
    status = _version()["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert _undescribed(status) == []


def test_spec_schema_defaults_equal_the_dataclass_defaults() -> None:
    defaults = JobSpec(name="x", entrypoint=None).to_dict()  # type: ignore[arg-type]
    schema = spec_schema()["properties"]
    assert schema["nodes"]["properties"]["max"]["default"] == defaults["nodes"]["max"]
    assert schema["checkpoint"]["properties"]["async"]["default"] is True
    assert schema["checkpoint"]["properties"]["keep"]["default"] == defaults["checkpoint"]["keep"]
    assert (
        schema["rendezvous"]["properties"]["joinTimeout"]["default"]
        == defaults["rendezvous"]["join_timeout"]
    )
    ft = schema["faultTolerance"]["properties"]
    assert ft["preemptionGrace"]["default"] == defaults["fault_tolerance"]["preemption_grace"]
    assert schema["comm"]["properties"]["topologyLabels"]["default"] == ["zone", "rack", "host"]
    res = schema["resources"]["properties"]
    assert {k: res[k]["default"] for k in res} == defaults["resources"]
    # compression parameters carry no schema default (the loader rejects foreign ones)
    comp = schema["comm"]["properties"]["compression"]["properties"]
    assert comp["type"]["default"] == "none"
    assert "default" not in comp["rank"] and "Default: 1" in comp["rank"]["description"]


def test_entrypoint_is_required_and_typed_as_object() -> None:
    schema = spec_schema()
    assert schema["required"] == ["entrypoint"]
    assert schema["properties"]["entrypoint"]["type"] == "object"
    assert "default" not in schema["properties"]["entrypoint"]


def test_cel_rules_cover_what_openapi_cannot() -> None:
    schema = spec_schema()["properties"]
    rules = {r["rule"] for r in schema["nodes"]["x-kubernetes-validations"]}
    assert "self.min <= self.max" in rules
    entry = {r["rule"] for r in schema["entrypoint"]["x-kubernetes-validations"]}
    assert "has(self.script) != has(self.module)" in entry
    root = _version()["schema"]["openAPIV3Schema"]
    assert any("self.metadata.name" in r["rule"] for r in root["x-kubernetes-validations"])


def test_durations_accept_seconds_or_unit_strings() -> None:
    hang = spec_schema()["properties"]["faultTolerance"]["properties"]["hangTimeout"]
    assert hang["x-kubernetes-int-or-string"] is True
    assert hang["default"] == 300


def test_status_subresource_and_printer_columns() -> None:
    version = _version()
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Step"] == ".status.step"
    assert columns["World"] == ".status.worldSize"
    assert columns["Spares"] == ".status.spareCount"
    assert columns["Recoveries"] == ".status.recoveries"
    assert columns["Age"] == ".metadata.creationTimestamp"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for key in (
        "phase",
        "step",
        "worldSize",
        "activePods",
        "sparePods",
        "lastCheckpoint",
        "recoveries",
        "conditions",
        "completionTime",
    ):
        assert key in status
    assert {"Invalid", "Suspended"} <= set(status["phase"]["enum"])


def test_names() -> None:
    crd = crd_manifest()
    assert crd["metadata"]["name"] == "trainingjobs.ringmaster.dev"
    assert crd["spec"]["names"]["kind"] == "TrainingJob"
    assert crd["spec"]["scope"] == "Namespaced"


def test_descriptions_are_plain_text_for_kubectl_explain() -> None:
    # kubectl explain prints descriptions as written: no reStructuredText markup
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            text = node.get("description")
            if isinstance(text, str) and ("``" in text or ":mod:" in text or ":func:" in text):
                found.append(f"{path}: {text}")
            for key, sub in node.items():
                walk(sub, f"{path}.{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                walk(sub, f"{path}[{i}]")

    walk(crd_manifest(), "")
    assert found == []


def test_the_crd_carries_the_spec_bounds() -> None:
    """The API server refuses what the job spec refuses: one source, spec_bounds."""
    schema = spec_schema()["properties"]
    nodes = schema["nodes"]["properties"]
    assert schema["nprocPerNode"]["maximum"] == MAX_NPROC_PER_NODE
    assert nodes["max"]["maximum"] == nodes["min"]["maximum"] == MAX_NODES
    assert nodes["spares"]["maximum"] == MAX_NODES
    assert schema["maxSteps"]["maximum"] == INT64_MAX
    rules = [r["rule"] for r in schema["nodes"]["x-kubernetes-validations"]]
    assert f"self.max + self.spares <= {MAX_NODES}" in rules
    # each is the spec's own: at it the spec validates, past it not
    cases: dict[str, Callable[[int], dict[str, Any]]] = {
        "nproc_per_node": lambda v: {"nproc_per_node": v},
        "max_steps": lambda v: {"max_steps": v},
        "nodes.max": lambda v: {"nodes": {"min": 1, "max": v}},
        "nodes.min": lambda v: {"nodes": {"min": v, "max": v}},
        # the spares' own maximum is the sum's (the CEL rule): with one node to train
        "nodes.spares": lambda v: {"nodes": {"min": 1, "max": 1, "spares": v - 1}},
        "sync.inner_steps": lambda v: {"sync": {"mode": "diloco", "inner_steps": v}},
        "sync.fragments": lambda v: {
            "sync": {"mode": "streaming_diloco", "inner_steps": v, "fragments": v}
        },
    }
    assert set(cases) == set(MAXIMUMS)
    for path, fields in cases.items():
        given = {"name": "b", "entrypoint": {"script": "t.py"}}
        load_job_data({**given, **fields(MAXIMUMS[path])})
        with pytest.raises(SpecError):
            load_job_data({**given, **fields(MAXIMUMS[path] + 1)})
