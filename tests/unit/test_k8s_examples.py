"""Example TrainingJobs pass the CRD's own schema and the spec loader; bad ones do not.

There is no API server here, so the CRD's openAPIV3Schema is checked with
``jsonschema`` after a small conversion (``x-kubernetes-int-or-string`` → an
integer-or-string type; unknown fields rejected, as ``kubectl``'s strict field
validation does), and the API server's defaulting is imitated from the schema's
``default`` values.  CEL rules (``x-kubernetes-validations``) cannot be
evaluated without an API server: the cross-field checks they express
(``nodes.min <= nodes.max``, one of script/module) are also made by the spec
loader, which the operator runs on every spec, and those are tested here
through :func:`orchestrator.operator.reconcile.job_spec_from_body`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from orchestrator.api import SpecError
from orchestrator.operator.crd import crd_manifest
from orchestrator.operator.reconcile import job_spec_from_body

pytestmark = pytest.mark.unit

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "k8s" / "examples").glob("*.yaml"))


def to_json_schema(node: Any) -> Any:
    """openAPI v3 (structural, as in a CRD) → JSON Schema with strict unknown fields."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if "properties" in out:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
    out.pop("default", None)
    return out


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Fill in ``default`` values the way the API server does (parents before children)."""
    if not isinstance(obj, dict) or "properties" not in schema:
        return obj
    out = dict(obj)
    for key, sub in schema["properties"].items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


ROOT_SCHEMA = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
VALIDATOR = jsonschema.Draft7Validator(to_json_schema(ROOT_SCHEMA))


def schema_errors(obj: dict[str, Any]) -> list[str]:
    return [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in VALIDATOR.iter_errors(obj)
    ]


def as_created(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server would store it: defaulted, with a uid."""
    out = apply_defaults(ROOT_SCHEMA, obj)
    out["metadata"] = {**out["metadata"], "uid": "uid-1", "namespace": "default"}
    return dict(out)


def load(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text(encoding="utf-8")))


def test_there_is_a_cpu_and_a_gpu_example() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"trainingjob-cpu.yaml", "trainingjob-gpu.yaml"} <= names
    gpu = load(next(p for p in EXAMPLES if p.name == "trainingjob-gpu.yaml"))
    assert gpu["spec"]["resources"]["gpus"] > 0


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_the_crd_schema(path: Path) -> None:
    obj = load(path)
    assert obj["apiVersion"] == "ringmaster.dev/v1alpha1" and obj["kind"] == "TrainingJob"
    assert schema_errors(obj) == []
    assert schema_errors(as_created(obj)) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_defaulted_example_passes_the_spec_loader(path: Path) -> None:
    obj = as_created(load(path))
    spec = job_spec_from_body(obj)
    assert spec.name == obj["metadata"]["name"]
    assert spec.nodes.min <= spec.nodes.max


def test_demo_job_file_is_a_valid_trainingjob_spec() -> None:
    """One file format: a job file's content is a TrainingJob spec (entrypoint as a mapping)."""
    job_file = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
    spec = load(job_file)
    name = spec.pop("name")
    obj = {"apiVersion": "ringmaster.dev/v1alpha1", "kind": "TrainingJob"}
    obj.update(metadata={"name": name}, spec=spec)
    assert schema_errors(obj) == []
    assert job_spec_from_body(as_created(obj)).name == name


def _cpu() -> dict[str, Any]:
    return load(next(p for p in EXAMPLES if p.name == "trainingjob-cpu.yaml"))


def test_missing_entrypoint_is_rejected_by_the_schema_and_the_loader() -> None:
    obj = _cpu()
    del obj["spec"]["entrypoint"]
    assert any("'entrypoint' is a required property" in e for e in schema_errors(obj))
    with pytest.raises(SpecError, match="entrypoint: is required"):
        job_spec_from_body(as_created(obj))


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("nodes", "max"), "four", "spec.nodes.max"),
        (("nproc_per_node",), 1.5, "spec.nproc_per_node"),
        (("checkpoint", "async"), "yes", "spec.checkpoint.async"),
        (("fault_tolerance", "hang_timeout"), True, "spec.fault_tolerance.hang_timeout"),
        (("fault_tolerance", "hang_timeout"), "soon", "spec.fault_tolerance.hang_timeout"),
        (("resources", "memory"), "lots", "spec.resources.memory"),
        (("comm", "compression", "type"), "zip", "spec.comm.compression.type"),
        (("entrypoint", "args"), "--lr 1", "spec.entrypoint.args"),
        (("nodes", "min"), 0, "spec.nodes.min"),
    ],
)
def test_wrong_types_are_rejected_by_the_schema(
    path: tuple[str, ...], value: Any, where: str
) -> None:
    obj = _cpu()
    target = obj["spec"]
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    errors = schema_errors(obj)
    assert any(e.startswith(where + ":") for e in errors), errors


def test_wrong_types_are_rejected_by_the_loader_too() -> None:
    obj = _cpu()
    obj["spec"]["nodes"]["max"] = "four"
    with pytest.raises(SpecError, match=r"nodes\.max: must be an integer"):
        job_spec_from_body(as_created(obj))


def test_unknown_fields_are_rejected() -> None:
    obj = _cpu()
    obj["spec"]["nodes"]["maximum"] = 3
    assert any("maximum" in e for e in schema_errors(obj))


def test_min_larger_than_max_is_rejected_by_the_loader() -> None:
    """openAPI cannot compare two fields: the CRD has a CEL rule, the loader checks too."""
    obj = _cpu()
    obj["spec"]["nodes"] = {"min": 4, "max": 2}
    assert schema_errors(obj) == []  # structurally fine; the CEL rule is the API server's
    rule = ROOT_SCHEMA["properties"]["spec"]["properties"]["nodes"]["x-kubernetes-validations"]
    assert rule[0]["rule"] == "self.min <= self.max"
    with pytest.raises(SpecError, match=r"nodes\.min \(4\) is larger than nodes\.max \(2\)"):
        job_spec_from_body(as_created(obj))


def test_script_and_module_together_are_rejected_by_the_loader() -> None:
    obj = _cpu()
    obj["spec"]["entrypoint"]["module"] = "pkg.train"
    with pytest.raises(SpecError, match="exactly one of 'script'"):
        job_spec_from_body(as_created(obj))


def test_spec_name_must_match_metadata_name() -> None:
    obj = _cpu()
    obj["spec"]["name"] = "other"
    with pytest.raises(SpecError, match=r"must equal metadata\.name"):
        job_spec_from_body(as_created(obj))


def test_foreign_compression_parameter_is_caught_by_the_loader_only() -> None:
    obj = _cpu()
    obj["spec"]["comm"] = {"compression": {"type": "topk", "rank": 4}}
    assert schema_errors(obj) == []
    with pytest.raises(SpecError, match="is not a parameter of compression 'topk'"):
        job_spec_from_body(as_created(obj))
