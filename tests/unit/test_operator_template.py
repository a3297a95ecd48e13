"""A TrainingJob's pod template merged into agent pods, and its conflicts reported.

The pure parts (rendering, conflicts) are tested directly; the handler tests use
the in-memory fake of the Kubernetes API from ``test_operator_handlers.py`` (no
API server can run on these machines).
"""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any

import kopf
import kubernetes_validate
import pytest

from orchestrator.operator import handlers
from orchestrator.operator.api import ANN_TEMPLATE_HASH, Observed, OperatorSettings
from orchestrator.operator.handlers import Runtime
from orchestrator.operator.reconcile import fields_from_body, load_training_job, reconcile
from orchestrator.spec.api import SpecError
from tests.unit.test_operator_handlers import FakeKube, FakeRecords

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
SETTINGS = OperatorSettings(etcd_endpoints=("etcd:2379",), service_account="default-sa")
K8S_VERSION = "1.37.0"

TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "llm"}, "annotations": {"example.com/owner": "ml"}},
    "spec": {
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": "tokens", "readOnly": True}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
        ],
        "containers": [
            {
                "name": "agent",
                "volumeMounts": [
                    {"name": "data", "mountPath": "/data", "readOnly": True},
                    {"name": "shm", "mountPath": "/dev/shm"},
                ],
                "env": [
                    {"name": "HF_HOME", "value": "/tmp/hf"},
                    {
                        "name": "WANDB_API_KEY",
                        "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}},
                    },
                ],
                "envFrom": [{"configMapRef": {"name": "nccl-tuning"}}],
                "resources": {"limits": {"amd.com/gpu": 8, "rdma/ib": "1"}},
            },
            {"name": "log-shipper", "image": "fluent/fluent-bit:3", "args": ["-c", "/etc/fb"]},
        ],
        "nodeSelector": {"accelerator": "mi300x"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}
                    ]
                }
            }
        },
        "tolerations": [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "imagePullSecrets": [{"name": "registry-credentials"}],
        "priorityClassName": "training-high",
        "serviceAccountName": "checkpoint-writer",
    },
}


def job(template: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "entrypoint": {"script": "train.py"},
        "nodes": {"min": 1, "max": 2, "spares": 1},
        "resources": {"image": "reg/trainer:1", "cpu": "8", "memory": "64Gi"},
    }
    if template is not None:
        base["template"] = template
    base.update(spec)
    return {
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": "demo",
            "namespace": "ml",
            "uid": "uid-1",
            "generation": 1,
            "labels": {"kueue.x-k8s.io/queue-name": "gpu-queue", "other": "x"},
        },
        "spec": base,
        "status": {},
    }


def render(body: dict[str, Any]) -> dict[str, Any]:
    plan = reconcile(body, Observed(), None, SETTINGS, NOW)
    return next(o for o in plan.create if o["kind"] == "Pod")


def agent_container(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "agent")


def test_agent_pod_from_a_template_with_volumes_selectors_tolerations_secrets_and_devices() -> None:
    pod = render(job(copy.deepcopy(TEMPLATE)))
    spec = pod["spec"]
    agent = agent_container(pod)
    # volumes: the data set and an in-memory /dev/shm that replaces the operator's default
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "tokens"
    assert "dshm" not in volumes and volumes["shm"]["emptyDir"]["sizeLimit"] == "16Gi"
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert mounts["/data"] == "data" and mounts["/dev/shm"] == "shm"
    assert mounts["/etc/ringmaster/podinfo"] == "podinfo"  # the operator's own stay
    # node selection, scheduling, identity
    assert spec["nodeSelector"] == {"accelerator": "mi300x"}
    assert spec["affinity"] == TEMPLATE["spec"]["affinity"]
    assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert spec["priorityClassName"] == "training-high"
    assert spec["serviceAccountName"] == "checkpoint-writer"  # the job's wins over the default
    # a non-NVIDIA device and an RDMA device, beside the operator's cpu and memory
    assert agent["resources"]["limits"] == {
        "cpu": "8",
        "memory": "64Gi",
        "amd.com/gpu": "8",
        "rdma/ib": "1",
    }
    assert agent["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    env = {e["name"]: e for e in agent["env"]}
    assert env["HF_HOME"]["value"] == "/tmp/hf"
    assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "wandb"
    assert env["RINGMASTER_JOB"]["value"] == "demo"  # the operator's still there
    assert agent["envFrom"] == [{"configMapRef": {"name": "nccl-tuning"}}]
    assert agent["command"][:2] == ["/bin/sh", "-c"] and agent["image"] == "reg/trainer:1"
    sidecar = next(c for c in spec["containers"] if c["name"] == "log-shipper")
    assert sidecar == {
        "name": "log-shipper",
        "image": "fluent/fluent-bit:3",
        "args": ["-c", "/etc/fb"],
    }
    # metadata: template labels and annotations, the Kueue queue passed through
    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels["team"] == "llm" and labels["ringmaster.dev/role"] == "agent"
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-queue" and "other" not in labels
    assert annotations["example.com/owner"] == "ml"
    # and the result is a valid Pod for Kubernetes
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == "1.37"


def test_without_a_template_the_operator_defaults_stay() -> None:
    pod = render(job())
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    assert pod["spec"]["serviceAccountName"] == "default-sa"
    assert "nodeSelector" not in pod["spec"] and "imagePullSecrets" not in pod["spec"]


def test_the_controller_schedules_where_the_agents_may() -> None:
    """On a cluster of tainted GPU nodes the controller needs the template's scheduling."""
    template = copy.deepcopy(TEMPLATE)
    anti = {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {
                "labelSelector": {"matchLabels": {"ringmaster.dev/job": "demo"}},
                "topologyKey": "kubernetes.io/hostname",
            }
        ]
    }
    template["spec"]["affinity"]["podAntiAffinity"] = anti
    body = job(template, resources={"image": "reg/trainer:1", "cpu": "8", "gpus": 8})
    plan = reconcile(body, Observed(), None, SETTINGS, NOW)
    deployment = next(o for o in plan.create if o["kind"] == "Deployment")
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"accelerator": "mi300x"}
    # node affinity only: a pod anti-affinity written for the agents could leave no node
    assert pod_spec["affinity"] == {"nodeAffinity": TEMPLATE["spec"]["affinity"]["nodeAffinity"]}
    assert pod_spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert pod_spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod_spec["priorityClassName"] == "training-high"
    # not the agents' data, devices or cloud identity
    assert pod_spec["serviceAccountName"] == "default-sa"
    assert [v["name"] for v in pod_spec["volumes"]] == ["tmp"]
    assert [c["name"] for c in pod_spec["containers"]] == ["controller"]
    assert "limits" in pod_spec["containers"][0]["resources"]
    assert set(pod_spec["containers"][0]["resources"]["limits"]) == {"memory"}
    assert kubernetes_validate.validate(deployment, K8S_VERSION, strict=True) == "1.37"
    # the agents keep their pod anti-affinity
    agent = next(o for o in plan.create if o["kind"] == "Pod")
    assert agent["spec"]["affinity"]["podAntiAffinity"] == anti


def test_without_a_template_the_controller_has_no_scheduling_constraints() -> None:
    plan = reconcile(job(), Observed(), None, SETTINGS, NOW)
    deployment = next(o for o in plan.create if o["kind"] == "Deployment")
    pod_spec = deployment["spec"]["template"]["spec"]
    for key in ("nodeSelector", "affinity", "tolerations", "imagePullSecrets", "priorityClassName"):
        assert key not in pod_spec


def test_a_template_change_rolls_the_pods() -> None:
    before = render(job(copy.deepcopy(TEMPLATE)))
    changed = copy.deepcopy(TEMPLATE)
    changed["spec"]["nodeSelector"] = {"accelerator": "mi355x"}
    after = render(job(changed))
    relabelled = copy.deepcopy(TEMPLATE)
    relabelled["metadata"]["labels"]["team"] = "vision"
    assert len({p["metadata"]["annotations"][ANN_TEMPLATE_HASH] for p in (before, after)}) == 2
    third = render(job(relabelled))["metadata"]["annotations"][ANN_TEMPLATE_HASH]
    assert third != before["metadata"]["annotations"][ANN_TEMPLATE_HASH]


CONFLICTS = [
    (
        {"containers": [{"name": "agent", "env": [{"name": "RINGMASTER_JOB", "value": "x"}]}]},
        "template.spec.containers[0].env[0].name",
        "RINGMASTER_JOB is set by the operator",
    ),
    (
        {"containers": [{"name": "agent", "command": ["python", "train.py"]}]},
        "template.spec.containers[0].command",
        "spec.entrypoint",
    ),
    (
        {"containers": [{"name": "agent", "image": "other:2"}]},
        "template.spec.containers[0].image",
        "resources.image",
    ),
    (
        {"containers": [{"name": "agent", "resources": {"limits": {"cpu": "4"}}}]},
        "template.spec.containers[0].resources.limits.cpu",
        "resources.cpu",
    ),
    (
        {"containers": [{"name": "agent", "resources": {"limits": {"nvidia.com/gpu": 8}}}]},
        "template.spec.containers[0].resources.limits.nvidia.com/gpu",
        "resources.gpus",
    ),
    (
        {"volumes": [{"name": "tmp", "emptyDir": {}}]},
        "template.spec.volumes[0].name",
        "'tmp' is a volume of the operator's",
    ),
    (
        {"containers": [{"name": "agent", "volumeMounts": [{"name": "x", "mountPath": "/x"}]}]},
        "template.spec.containers[0].volumeMounts[0].name",
        "no volume named 'x'",
    ),
    (
        {
            "volumes": [{"name": "v", "emptyDir": {}}],
            "containers": [
                {
                    "name": "agent",
                    "volumeMounts": [{"name": "v", "mountPath": "/etc/ringmaster/podinfo"}],
                }
            ],
        },
        "template.spec.containers[0].volumeMounts[0].mountPath",
        "where the operator mounts its own files",
    ),
    (
        {"containers": [{"name": "sidecar"}]},
        "template.spec.containers[0].image",
        "needs an image",
    ),
]


@pytest.mark.parametrize(("pod_spec", "path", "words"), CONFLICTS, ids=[c[1] for c in CONFLICTS])
def test_a_conflict_names_the_template_field_and_what_to_do(
    pod_spec: dict[str, Any], path: str, words: str
) -> None:
    with pytest.raises(SpecError) as caught:
        load_training_job(job({"spec": pod_spec}), SETTINGS)
    (problem,) = caught.value.problems
    assert problem.path == path
    assert words in problem.message


def test_owned_labels_and_annotations_conflict() -> None:
    template = {
        "metadata": {
            "labels": {"ringmaster.dev/role": "x", "app.kubernetes.io/name": "y"},
            "annotations": {"ringmaster.dev/index": "0"},
        }
    }
    with pytest.raises(SpecError) as caught:
        load_training_job(job(template), SETTINGS)
    paths = sorted(p.path for p in caught.value.problems)
    assert paths == [
        "template.metadata.annotations.ringmaster.dev/index",
        "template.metadata.labels.app.kubernetes.io/name",
        "template.metadata.labels.ringmaster.dev/role",
    ]


@pytest.mark.parametrize("key", ["kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class"])
def test_a_kueue_label_in_the_template_conflicts_instead_of_being_overridden(key: str) -> None:
    # the TrainingJob's own label is copied to the pods; the template's would lose silently
    body = job({"metadata": {"labels": {key: "other-queue", "kueue.x-k8s.io/x": "kept"}}})
    with pytest.raises(SpecError) as caught:
        load_training_job(body, SETTINGS)
    (problem,) = caught.value.problems
    assert problem.path == f"template.metadata.labels.{key}"
    assert "TrainingJob's own metadata.labels" in problem.message
    # on the TrainingJob itself it is fine, and other kueue.x-k8s.io/ keys pass as given
    body["spec"]["template"]["metadata"]["labels"].pop(key)
    labels = render(body)["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert labels["kueue.x-k8s.io/x"] == "kept"


def test_unknown_and_mistyped_template_fields_are_named() -> None:
    body = job({"spec": {"nodeSelectr": {"a": "b"}, "tolerations": [{"effect": "Never"}]}})
    with pytest.raises(SpecError) as caught:
        fields_from_body(body)
    found = {p.path: p.message for p in caught.value.problems}
    assert "did you mean 'nodeSelector'?" in found["template.spec.nodeSelectr"]
    assert "'Never' is not one of" in found["template.spec.tolerations[0].effect"]


def test_a_conflict_shows_in_the_status_and_creates_nothing() -> None:
    """Through the handler, on the in-memory fake of the Kubernetes API."""
    kube, records = FakeKube(), FakeRecords()
    runtime = Runtime(kube=kube, records=records, settings=SETTINGS, clock=lambda: NOW)
    body = job({"spec": {"containers": [{"name": "agent", "env": [{"name": "POD_IP"}]}]}})
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError):
        handlers.on_spec(body=body, memo=kopf.Memo(runtime=runtime), patch=patch)
    status = patch["status"]
    assert status["phase"] == "Invalid"
    assert (
        "template.spec.containers[0].env[0].name: POD_IP is set by the operator"
        in (status["message"])
    )
    (valid,) = [c for c in status["conditions"] if c["type"] == "SpecValid"]
    assert valid["status"] == "False"
    assert kube.objects == {} and records.specs == {}  # nothing created, nothing submitted
    assert [(e[1], e[2]) for e in kube.events] == [("Warning", "InvalidSpec")]
    # the same rejection again posts no second event
    body["status"] = status
    with pytest.raises(kopf.PermanentError):
        handlers.on_spec(body=body, memo=kopf.Memo(runtime=runtime), patch=kopf.Patch())
    assert len(kube.events) == 1


def test_every_conflict_is_reported_at_once() -> None:
    template = {
        "metadata": {"labels": {"ringmaster.dev/job": "x"}},
        "spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]},
    }
    body = job(template, nodes={"min": 3, "max": 2})
    with pytest.raises(SpecError) as caught:
        load_training_job(body, SETTINGS)
    paths = sorted(p.path for p in caught.value.problems)
    assert paths == ["nodes.min", "template.metadata.labels.ringmaster.dev/job"]
    body["spec"]["nodes"] = {"min": 1, "max": 2}
    with pytest.raises(SpecError) as caught:
        load_training_job(body, SETTINGS)
    paths = sorted(p.path for p in caught.value.problems)
    assert paths == ["template.metadata.labels.ringmaster.dev/job", "template.spec.volumes[0].name"]


# --------------------------------------------------------------------------- security


def test_the_agent_may_add_ipc_lock_and_run_as_root_for_rdma() -> None:
    template = {
        "spec": {
            "containers": [
                {
                    "name": "agent",
                    "securityContext": {
                        "runAsUser": 0,
                        "runAsNonRoot": False,
                        "capabilities": {"add": ["IPC_LOCK", "IPC_LOCK"]},
                    },
                    "resources": {"limits": {"rdma/ib": 1}},
                }
            ]
        }
    }
    pod = render(job(template))
    ctx = agent_container(pod)["securityContext"]
    assert ctx == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
        "runAsUser": 0,
        "runAsNonRoot": False,
    }
    # the pod's own defaults stay for every other container
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == "1.37"


SECURITY_CONFLICTS = [
    ({"capabilities": {"drop": ["NET_RAW"]}}, "capabilities.drop", "drops ALL"),
    ({"capabilities": {"add": ["IPC_LOCK", "ALL"]}}, "capabilities.add[1]", "not ALL"),
    ({"readOnlyRootFilesystem": False}, "readOnlyRootFilesystem", "the operator's (true)"),
    ({"allowPrivilegeEscalation": True}, "allowPrivilegeEscalation", "the operator's (false)"),
    ({"privileged": True}, "privileged", "the operator's (false)"),
    ({"runAsUser": 0}, "runAsUser", "needs runAsNonRoot: false"),
    ({"runAsUser": 0, "runAsNonRoot": True}, "runAsUser", "needs runAsNonRoot: false"),
]


@pytest.mark.parametrize(
    ("ctx", "path", "words"), SECURITY_CONFLICTS, ids=[c[1] for c in SECURITY_CONFLICTS]
)
def test_the_agents_security_settings_the_operator_owns_conflict(
    ctx: dict[str, Any], path: str, words: str
) -> None:
    template = {"spec": {"containers": [{"name": "agent", "securityContext": ctx}]}}
    with pytest.raises(SpecError) as caught:
        load_training_job(job(template), SETTINGS)
    (problem,) = caught.value.problems
    assert problem.path == f"template.spec.containers[0].securityContext.{path}"
    assert words in problem.message


def test_an_unknown_capability_is_named() -> None:
    template = {
        "spec": {
            "containers": [
                {"name": "agent", "securityContext": {"capabilities": {"add": ["IPC_LOK"]}}}
            ]
        }
    }
    with pytest.raises(SpecError) as caught:
        fields_from_body(job(template))
    (problem,) = caught.value.problems
    assert problem.path == "template.spec.containers[0].securityContext.capabilities.add[0]"
    assert "'IPC_LOK' is not one of" in problem.message


def test_a_sidecar_sets_its_own_security_context() -> None:
    # the pod runs every container as user 1000, non-root: an image that needs root says so
    ctx = {
        "runAsUser": 0,
        "runAsNonRoot": False,
        "readOnlyRootFilesystem": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["DAC_READ_SEARCH"]},
    }
    template = {
        "spec": {
            "containers": [
                {"name": "log-shipper", "image": "fluent/fluent-bit:3", "securityContext": ctx}
            ]
        }
    }
    pod = render(job(template))
    sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "log-shipper")
    assert sidecar["securityContext"] == ctx
    assert agent_container(pod)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == "1.37"
