"""Example TrainingJobs pass the CRD's own schema and the spec loader; bad ones do not.

There is no API server here, so the CRD's openAPIV3Schema is checked with
``jsonschema`` after a small conversion (``x-kubernetes-int-or-string`` → an
integer-or-string type; unknown fields rejected, as ``kubectl``'s strict field
validation does), and the API server's defaulting is imitated from the schema's
``default`` values.  The CRD's CEL rules (``x-kubernetes-validations``:
``nodes.min <= nodes.max``, one of script/module...) are evaluated with
``cel-python`` on the defaulted object, where the API server would evaluate
them; the spec loader, which the operator runs on every spec, makes the same
checks, tested here through
:func:`orchestrator.operator.reconcile.job_spec_from_body`.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.operator.api import Observed, OperatorSettings
from orchestrator.operator.crd import crd_manifest
from orchestrator.operator.reconcile import job_spec_from_body, reconcile
from orchestrator.spec.api import SpecError
from orchestrator.spec.dataclass_tree import camel_key
from orchestrator.spec.job import JobSpec

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
    if (
        node.get("type") == "object"
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")  # a free-form k8s object
    ):
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


CEL = celpy.Environment()


def cel_errors(schema: dict[str, Any], obj: Any, path: str = "") -> list[str]:
    """The messages of the CEL rules ``obj`` breaks, at every level of ``schema``."""
    out: list[str] = []
    if not isinstance(obj, dict):
        return out
    for rule in schema.get("x-kubernetes-validations") or []:
        program = CEL.program(CEL.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(obj)})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            out.append(f"{path or '<root>'}: {rule['message']}")
    for key, sub in (schema.get("properties") or {}).items():
        if key in obj:
            out += cel_errors(sub, obj[key], f"{path}.{key}" if path else key)
    return out


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """What the API server would refuse: the openAPI schema, then the CEL rules after defaulting."""
    found = [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in VALIDATOR.iter_errors(obj)
    ]
    defaulted = apply_defaults(ROOT_SCHEMA, obj)
    return found or cel_errors(ROOT_SCHEMA, defaulted)


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


def camel_case(cls: type, data: Any) -> Any:
    """A job file's data with every field key in camelCase (user keys like env names kept)."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return data
    hints = typing.get_type_hints(cls)
    fields = {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls)}
    out = {}
    for key, value in data.items():
        f = fields[key]
        inner = hints[f.name]
        args = [a for a in typing.get_args(inner) if a is not type(None)]
        inner = args[0] if typing.get_origin(inner) in (typing.Union, types.UnionType) else inner
        out[camel_key(key)] = camel_case(inner, value)
    return out


def test_demo_job_file_is_a_valid_trainingjob_spec() -> None:
    """One file format: a job file's content, in camelCase, is a TrainingJob spec."""
    job_file = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
    spec = camel_case(JobSpec, load(job_file))
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
        (("nprocPerNode",), 1.5, "spec.nprocPerNode"),
        (("checkpoint", "async"), "yes", "spec.checkpoint.async"),
        (("faultTolerance", "hangTimeout"), True, "spec.faultTolerance.hangTimeout"),
        (("faultTolerance", "hangTimeout"), "soon", "spec.faultTolerance.hangTimeout"),
        (("nproc_per_node",), 2, "spec"),  # snake_case is the job file's; not a TrainingJob's
        (("suspend",), "yes", "spec.suspend"),
        (("ttlSecondsAfterFinished",), -1, "spec.ttlSecondsAfterFinished"),
        (("template", "spec", "nodeSelector"), ["gpu"], "spec.template.spec.nodeSelector"),
        (
            ("template", "spec", "tolerations"),
            [{"effect": "Never"}],
            "spec.template.spec.tolerations.0.effect",
        ),
        (("template", "spec", "volumes"), [{"emptyDir": {}}], "spec.template.spec.volumes.0"),
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


def test_min_larger_than_max_is_rejected_by_the_schema_and_the_loader() -> None:
    """openAPI cannot compare two fields: the CRD's CEL rule does, and the loader too."""
    obj = _cpu()
    obj["spec"]["nodes"] = {"min": 4, "max": 2}
    assert schema_errors(obj) == ["spec.nodes: nodes.min must not be larger than nodes.max"]
    obj["spec"]["nodes"] = {"min": 4}  # max defaults to 1: still refused
    assert schema_errors(obj) == ["spec.nodes: nodes.min must not be larger than nodes.max"]
    obj["spec"]["nodes"] = {"min": 4, "max": 2}
    with pytest.raises(SpecError, match=r"nodes\.min \(4\) is larger than nodes\.max \(2\)"):
        job_spec_from_body(as_created(obj))


def test_cel_rules_catch_script_and_module_and_a_foreign_name() -> None:
    obj = _cpu()
    obj["spec"]["entrypoint"]["module"] = "pkg.train"
    assert schema_errors(obj) == [
        "spec.entrypoint: give exactly one of 'script' (a path) or 'module' (python -m name)"
    ]
    obj = _cpu()
    obj["spec"]["name"] = "other"
    assert schema_errors(obj) == ["<root>: spec.name must equal metadata.name (or be left out)"]


def test_unknown_template_fields_are_rejected_by_the_schema() -> None:
    obj = _cpu()
    obj["spec"]["template"] = {"spec": {"hostNetwork": True}}
    assert any("hostNetwork" in e for e in schema_errors(obj))
    obj["spec"]["template"] = {
        "spec": {"containers": [{"name": "agent", "ports": [{"containerPort": 80}]}]}
    }
    assert any("ports" in e for e in schema_errors(obj))
    obj["spec"]["template"] = {"metadata": {"name": "x"}}
    assert any("'name' was unexpected" in e for e in schema_errors(obj))
    # a Kubernetes Volume is kept whole (the API server checks it when the pod is created)
    obj["spec"]["template"] = {
        "spec": {"volumes": [{"name": "data", "nfs": {"server": "fs", "path": "/x"}}]}
    }
    assert schema_errors(obj) == []


def test_every_example_renders_pods_and_children_kubernetes_accepts() -> None:
    """The operator's output for each example validates against the Kubernetes schemas."""
    for path in EXAMPLES:
        obj = as_created(load(path))
        plan = reconcile(
            obj,
            Observed(),
            None,
            OperatorSettings(etcd_endpoints=("etcd:2379",)),
            datetime(2026, 1, 1, tzinfo=timezone.utc),
        )
        assert {o["kind"] for o in plan.create} == {
            "Pod",
            "Service",
            "Deployment",
            "PodDisruptionBudget",
        }
        for child in plan.create:
            assert kubernetes_validate.validate(child, "1.37.0", strict=True) == "1.37", path


def test_gpu_example_mounts_its_data_and_shared_memory_on_gpu_nodes() -> None:
    obj = as_created(load(next(p for p in EXAMPLES if p.name == "trainingjob-gpu.yaml")))
    plan = reconcile(
        obj,
        Observed(),
        None,
        OperatorSettings(etcd_endpoints=("etcd:2379",)),
        datetime(2026, 1, 1, tzinfo=timezone.utc),
    )
    pod = next(o for o in plan.create if o["kind"] == "Pod")
    agent = pod["spec"]["containers"][0]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[mounts["/data"]["name"]]["persistentVolumeClaim"]["readOnly"] is True
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert "nvidia.com/gpu.product" in pod["spec"]["nodeSelector"]
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    # RDMA: the device, and IPC_LOCK for a root agent (an added capability needs root)
    assert agent["resources"]["limits"]["rdma/ib"] == "1"
    ctx = agent["securityContext"]
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert ctx["runAsUser"] == 0 and ctx["runAsNonRoot"] is False
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    # the controller schedules on the same (tainted) GPU nodes, without their devices
    deployment = next(o for o in plan.create if o["kind"] == "Deployment")
    controller = deployment["spec"]["template"]["spec"]
    assert controller["nodeSelector"] == pod["spec"]["nodeSelector"]
    assert controller["tolerations"] == pod["spec"]["tolerations"]
    assert controller["priorityClassName"] == pod["spec"]["priorityClassName"]
    assert set(controller["containers"][0]["resources"]["requests"]) == {"cpu", "memory"}


def test_security_contexts_in_the_template_are_checked_by_the_schema() -> None:
    obj = _cpu()

    def with_context(ctx: dict[str, Any]) -> list[str]:
        obj["spec"]["template"] = {
            "spec": {"containers": [{"name": "agent", "securityContext": ctx}]}
        }
        return schema_errors(obj)

    assert with_context({"capabilities": {"add": ["IPC_LOCK"]}}) == []
    assert any(
        "'IPC_LOK' is not one of" in e for e in with_context({"capabilities": {"add": ["IPC_LOK"]}})
    )
    assert any("seLinuxOptions" in e for e in with_context({"seLinuxOptions": {"type": "x"}}))
    assert any("-1 is less than the minimum" in e for e in with_context({"runAsUser": -1}))


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


def test_the_gpu_examples_prerequisites_are_valid_and_named_as_it_uses_them() -> None:
    path = EXAMPLES[0].parent / "prerequisites" / "trainingjob-gpu.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    for doc in docs:
        assert kubernetes_validate.validate(doc, "1.37.0", strict=True) == "1.37", doc["kind"]
    by_kind = {d["kind"]: d for d in docs}
    gpu = load(next(p for p in EXAMPLES if p.name == "trainingjob-gpu.yaml"))
    template = gpu["spec"]["template"]["spec"]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in template["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == [by_kind["PersistentVolumeClaim"]["metadata"]["name"]]
    assert by_kind["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert template["priorityClassName"] == by_kind["PriorityClass"]["metadata"]["name"]
