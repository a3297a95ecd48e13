"""Every manifest in k8s/ is valid Kubernetes, and the install is least-privilege.

Validation uses ``kubernetes-validate``, whose JSON schemas of each Kubernetes
release ship inside the package: the tests run without network and without an
API server (one test proves it by refusing every socket connection).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.unit

K8S = Path(__file__).resolve().parents[2] / "k8s"
K8S_VERSION = "1.37.0"
BUILTIN_KINDS = {
    "Namespace",
    "CustomResourceDefinition",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Deployment",
    "Service",
    "StatefulSet",
    "PodDisruptionBudget",
}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def manifests() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in documents(path):
            yield f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc


ALL = list(manifests())


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in ALL if doc["kind"] == kind]


@pytest.mark.parametrize(("where", "doc"), ALL, ids=[w for w, _ in ALL])
def test_manifest_validates_against_kubernetes_schemas(where: str, doc: dict[str, Any]) -> None:
    assert doc["kind"] in BUILTIN_KINDS, where
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == "1.37"


def test_strict_validation_rejects_a_typo() -> None:
    deployment = yaml.safe_load(yaml.safe_dump(by_kind("Deployment")[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "Sometimes"
    deployment["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_validation_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError("network is off in this test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    crd = documents(K8S / "crd.yaml")[0]
    assert kubernetes_validate.validate(crd, K8S_VERSION, strict=True) == "1.37"


def test_kustomization_lists_every_manifest() -> None:
    kustomization = documents(K8S / "kustomization.yaml")[0]
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_offline() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    assert kinds.count("CustomResourceDefinition") == 1
    assert "StatefulSet" in kinds and "ClusterRole" in kinds


def test_etcd_statefulset_has_three_members_and_services() -> None:
    (sts,) = by_kind("StatefulSet")
    assert sts["spec"]["replicas"] == 3
    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    args = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["command"])
    for i in range(3):
        assert f"ringmaster-etcd-{i}=http://ringmaster-etcd-{i}." in args


def test_operator_points_at_every_etcd_member() -> None:
    (deployment,) = [
        d for d in by_kind("Deployment") if d["metadata"]["name"] == "ringmaster-operator"
    ]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["ringmaster", "operator"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RINGMASTER_ETCD"].count(":2379") == 3
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "ringmaster-operator"


def test_pods_run_as_non_root() -> None:
    for doc in by_kind("Deployment") + by_kind("StatefulSet"):
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_rbac_is_least_privilege() -> None:
    (role,) = by_kind("ClusterRole")
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    for (group, resource), verbs in grants.items():
        assert "*" not in verbs and "*" not in (group, resource)
        assert not {"escalate", "bind", "impersonate"} & verbs
    # what the operator does, and no more than that on the sensitive ones
    assert grants[("", "nodes")] == {"get"}
    assert grants[("ringmaster.dev", "trainingjobs/status")] == {"get", "patch"}
    # ttlSecondsAfterFinished: the operator deletes finished TrainingJobs, and posts Events
    assert "delete" in grants[("ringmaster.dev", "trainingjobs")]
    assert grants[("", "events")] == {"create"}
    assert {"create", "delete", "list", "watch"} <= grants[("", "pods")]
    assert ("", "secrets") not in grants
    (binding,) = by_kind("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == "ringmaster-operator"


def test_dockerfile_pins_cpu_torch_before_the_project() -> None:
    text = (K8S / "Dockerfile").read_text(encoding="utf-8")
    torch_at = text.index('"torch==${TORCH_VERSION}"')
    project_at = text.index('pip install ".[operator]"')
    assert torch_at < project_at
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "download.pytorch.org/whl/cpu" in text
    assert "USER 1000" in text
