"""The kopf handlers, called directly as kopf would call them.

There is no Kubernetes API server on these machines, so these tests use a
fake: :class:`FakeKube`, an in-memory stand-in for the operator's
``KubeApi`` port, and :class:`FakeRecords` for etcd.  kopf itself is not
started; its ``Patch``, ``Memo`` and settings objects are real.  The real
client module (``kube.py``) is tested against an HTTP fake of the API in
``test_operator_kube_http.py``.
"""

from __future__ import annotations

import copy
import logging
from datetime import datetime, timedelta, timezone
from typing import Any

import kopf
import pytest

from orchestrator.operator import handlers
from orchestrator.operator.api import (
    JobEvent,
    Observed,
    OperatorSettings,
    PermanentOperatorError,
    RetryableOperatorError,
)
from orchestrator.operator.handlers import Runtime, sync_job

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
LOG = logging.getLogger("test-operator")
KINDS = {"Service": "service", "Deployment": "controller", "PodDisruptionBudget": "pdb"}


class FakeKube:
    """In-memory fake of the Kubernetes API port (no API server runs here)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, str]] = {}
        self.status_patches: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, str, str, str]] = []  # (job, type, reason, message)
        self.fail_with: Exception | None = None

    def _check(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with

    def list_children(self, namespace: str, job: str) -> Observed:
        self._check()
        out = Observed()
        for (ns, kind, _), obj in self.objects.items():
            if ns != namespace or obj["metadata"]["labels"].get("ringmaster.dev/job") != job:
                continue
            if kind == "Pod":
                out.pods.append(copy.deepcopy(obj))
            elif kind == "Service" and obj["metadata"]["name"].endswith("-metrics"):
                out.metrics_service = copy.deepcopy(obj)
            else:
                setattr(out, KINDS[kind], copy.deepcopy(obj))
        return out

    def create(self, obj: dict[str, Any]) -> None:
        self._check()
        key = (obj["metadata"]["namespace"], obj["kind"], obj["metadata"]["name"])
        self.objects.setdefault(key, copy.deepcopy(obj))

    def replace(self, obj: dict[str, Any]) -> None:
        self._check()
        key = (obj["metadata"]["namespace"], obj["kind"], obj["metadata"]["name"])
        self.objects[key] = copy.deepcopy(obj)

    def delete(self, namespace: str, kind: str, name: str) -> None:
        self._check()
        self.objects.pop((namespace, kind, name), None)
        if kind == "TrainingJob":
            self.jobs.pop((namespace, name), None)

    def node_labels(self, node: str) -> dict[str, str]:
        self._check()
        return dict(self.nodes.get(node, {}))

    def annotate_pod(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str],
        labels: dict[str, str] | None = None,
    ) -> None:
        self._check()
        pod = self.objects[(namespace, "Pod", name)]
        pod["metadata"].setdefault("annotations", {}).update(annotations)
        pod["metadata"].setdefault("labels", {}).update(labels or {})

    def post_event(self, job: dict[str, Any], event: JobEvent) -> None:
        self.events.append((job["metadata"]["name"], event.type, event.reason, event.message))

    def get_training_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.jobs.get((namespace, name)))

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.status_patches.append((name, status))

    def pods(self) -> list[str]:
        return sorted(n for (_, kind, n) in self.objects if kind == "Pod")


class FakeRecords:
    """In-memory fake of the etcd records port."""

    def __init__(self) -> None:
        self.specs: dict[str, Any] = {}
        self.statuses: dict[str, dict[str, Any]] = {}
        self.forgotten: list[tuple[tuple[str, ...], str]] = []
        self.fail_with: Exception | None = None

    def ensure_spec(self, endpoints: tuple[str, ...], spec: Any) -> bool:
        if self.fail_with is not None:
            raise self.fail_with
        changed = self.specs.get(spec.name) != spec
        self.specs[spec.name] = spec
        return changed

    def read_status(self, endpoints: tuple[str, ...], job: str) -> dict[str, Any] | None:
        return self.statuses.get(job)

    def forget(self, endpoints: tuple[str, ...], job: str) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.forgotten.append((endpoints, job))


def body(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "entrypoint": {"script": "train.py"},
        "nodes": {"min": 1, "max": 2, "spares": 1},
    }
    base.update(spec)
    return {
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": base,
        "status": {},
    }


@pytest.fixture
def runtime() -> Runtime:
    return Runtime(
        kube=FakeKube(),
        records=FakeRecords(),
        settings=OperatorSettings(etcd_endpoints=("etcd:2379",)),
        clock=lambda: NOW,
    )


def fake_kube(runtime: Runtime) -> FakeKube:
    assert isinstance(runtime.kube, FakeKube)
    return runtime.kube


def fake_records(runtime: Runtime) -> FakeRecords:
    assert isinstance(runtime.records, FakeRecords)
    return runtime.records


def call_on_spec(runtime: Runtime, obj: dict[str, Any]) -> kopf.Patch:
    patch = kopf.Patch()
    handlers.on_spec(body=obj, memo=kopf.Memo(runtime=runtime), patch=patch, logger=LOG)
    return patch


def test_startup_keeps_kopf_state_out_of_the_status() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings)
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)


def test_create_writes_spec_children_and_status(runtime: Runtime) -> None:
    patch = call_on_spec(runtime, body())
    kube = fake_kube(runtime)
    assert kube.pods() == ["demo-agent-0", "demo-agent-1", "demo-agent-2"]
    assert ("ml", "Service", "demo-agents") in kube.objects
    assert ("ml", "Deployment", "demo-controller") in kube.objects
    assert ("ml", "PodDisruptionBudget", "demo-agents") in kube.objects
    assert fake_records(runtime).specs["demo"].nodes.max == 2
    assert patch["status"]["phase"] == "Pending"
    assert patch["status"]["desiredPods"] == 3


def test_create_is_idempotent(runtime: Runtime) -> None:
    obj = body()
    first = call_on_spec(runtime, obj)
    obj["status"] = first["status"]
    call_on_spec(runtime, obj)
    assert fake_kube(runtime).pods() == ["demo-agent-0", "demo-agent-1", "demo-agent-2"]


def test_spec_change_scales_and_rewrites_the_spec(runtime: Runtime) -> None:
    obj = body()
    obj["status"] = call_on_spec(runtime, obj)["status"]
    obj["spec"]["nodes"]["max"] = 4
    obj["metadata"]["generation"] = 2
    patch = call_on_spec(runtime, obj)
    assert len(fake_kube(runtime).pods()) == 5
    assert fake_records(runtime).specs["demo"].nodes.max == 4
    assert patch["status"]["observedGeneration"] == 2


def test_invalid_spec_is_permanent_and_shows_in_status(runtime: Runtime) -> None:
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match=r"nodes\.min \(5\) is larger"):
        handlers.on_spec(
            body=body(nodes={"min": 5, "max": 2}),
            memo=kopf.Memo(runtime=runtime),
            patch=patch,
            logger=LOG,
        )
    assert patch["status"]["phase"] == "Invalid"
    assert fake_kube(runtime).objects == {}


def test_etcd_unavailable_is_temporary(runtime: Runtime) -> None:
    fake_records(runtime).fail_with = RetryableOperatorError(
        "could not reach etcd", delay=timedelta(seconds=7)
    )
    with pytest.raises(kopf.TemporaryError) as caught:
        call_on_spec(runtime, body())
    assert caught.value.delay == 7


def test_api_refusal_is_permanent(runtime: Runtime) -> None:
    fake_kube(runtime).fail_with = PermanentOperatorError("the Kubernetes API refused it (422)")
    with pytest.raises(kopf.PermanentError, match="422"):
        call_on_spec(runtime, body())


def test_timer_copies_the_controller_status(runtime: Runtime) -> None:
    obj = body()
    obj["status"] = call_on_spec(runtime, obj)["status"]
    fake_records(runtime).statuses["demo"] = {
        "phase": "Running",
        "step": 120,
        "world_size": 2,
        "active_nodes": ["demo-agent-0", "demo-agent-1"],
        "spare_nodes": ["demo-agent-2"],
        "recoveries": 1,
        "last_checkpoint": "s3://b/demo/step-100",
    }
    patch = kopf.Patch()
    handlers.on_timer(body=obj, memo=kopf.Memo(runtime=runtime), patch=patch, logger=LOG)
    st = patch["status"]
    assert (st["phase"], st["step"], st["worldSize"], st["recoveries"]) == ("Running", 120, 2, 1)
    assert st["sparePods"] == ["demo-agent-2"]
    assert st["lastCheckpoint"] == "s3://b/demo/step-100"


def test_timer_reports_an_invalid_spec_without_raising(runtime: Runtime) -> None:
    patch = kopf.Patch()
    handlers.on_timer(
        body=body(nodes={"min": 3, "max": 1}),
        memo=kopf.Memo(runtime=runtime),
        patch=patch,
        logger=LOG,
    )
    assert patch["status"]["phase"] == "Invalid"


def test_failed_pod_event_replaces_it_at_once(runtime: Runtime) -> None:
    obj = body()
    obj["status"] = call_on_spec(runtime, obj)["status"]
    kube = fake_kube(runtime)
    kube.jobs[("ml", "demo")] = obj
    pod = kube.objects[("ml", "Pod", "demo-agent-1")]
    pod["status"] = {"phase": "Failed", "reason": "Preempted"}
    handlers.on_agent_pod(
        event={"type": "MODIFIED"}, body=pod, memo=kopf.Memo(runtime=runtime), logger=LOG
    )
    assert kube.pods() == ["demo-agent-0", "demo-agent-2", "demo-agent-3"]
    ((name, status),) = kube.status_patches
    assert name == "demo" and status["replacedPods"] == 1


def test_scheduled_pod_gets_topology_annotations(runtime: Runtime) -> None:
    call_on_spec(runtime, body())
    kube = fake_kube(runtime)
    kube.nodes["gpu-3"] = {
        "topology.kubernetes.io/zone": "z1",
        "topology.ringmaster.dev/rack": "r7",
    }
    pod = kube.objects[("ml", "Pod", "demo-agent-0")]
    pod["spec"]["nodeName"] = "gpu-3"
    pod["status"] = {"phase": "Pending"}
    handlers.on_agent_pod(
        event={"type": "MODIFIED"}, body=pod, memo=kopf.Memo(runtime=runtime), logger=LOG
    )
    annotations = kube.objects[("ml", "Pod", "demo-agent-0")]["metadata"]["annotations"]
    assert annotations["ringmaster.dev/zone"] == "z1"
    assert annotations["ringmaster.dev/rack"] == "r7"
    assert annotations["ringmaster.dev/host"] == "gpu-3"
    assert annotations["ringmaster.dev/topology-ready"] == "true"
    assert kube.status_patches == []  # nothing was lost: no re-sync


def test_delete_forgets_the_job_in_etcd(runtime: Runtime) -> None:
    handlers.on_delete(body=body(), memo=kopf.Memo(runtime=runtime), logger=LOG)
    assert fake_records(runtime).forgotten == [(("etcd:2379",), "demo")]


def test_delete_retries_while_etcd_is_down(runtime: Runtime) -> None:
    fake_records(runtime).fail_with = RetryableOperatorError("etcd down")
    with pytest.raises(kopf.TemporaryError):
        handlers.on_delete(body=body(), memo=kopf.Memo(runtime=runtime), logger=LOG)


def test_missing_runtime_is_a_permanent_error() -> None:
    with pytest.raises(kopf.PermanentError, match="runtime"):
        handlers.on_spec(body=body(), memo=kopf.Memo(), patch=kopf.Patch(), logger=LOG)


def test_sync_job_is_usable_without_kopf(runtime: Runtime) -> None:
    status = sync_job(runtime, body())
    assert status["nextPodIndex"] == 3


def test_kopf_body_objects_are_accepted(runtime: Runtime) -> None:
    """kopf hands over ``kopf.Body`` views, not dicts."""
    patch = call_on_spec(runtime, kopf.Body(body()))  # type: ignore[arg-type]
    assert patch["status"]["desiredPods"] == 3
