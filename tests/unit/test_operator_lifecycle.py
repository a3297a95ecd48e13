"""Suspend and resume, ttlSecondsAfterFinished, Events on the TrainingJob, the metrics Service.

The reconcile function is pure and tested directly; the handler tests use the
in-memory fake of the Kubernetes API from ``test_operator_handlers.py``, and
the last tests the HTTP fake of the API server from ``test_operator_kube_http.py``
(no Kubernetes API server can run on these machines).
"""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from typing import Any

import kopf
import kubernetes_validate
import pytest

from orchestrator.operator import handlers
from orchestrator.operator.api import Observed, OperatorSettings, ReconcilePlan
from orchestrator.operator.handlers import Runtime
from orchestrator.operator.kube import KubeClient
from orchestrator.operator.reconcile import reconcile
from tests.unit.test_operator_handlers import FakeKube, FakeRecords
from tests.unit.test_operator_kube_http import FakeApiServer

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
SETTINGS = OperatorSettings(etcd_endpoints=("etcd:2379",))


def job(**spec: Any) -> dict[str, Any]:
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


def run(
    body: dict[str, Any],
    observed: Observed | None = None,
    controller: dict[str, Any] | None = None,
    now: datetime = NOW,
) -> ReconcilePlan:
    return reconcile(body, observed or Observed(), controller, SETTINGS, now)


def pods(plan: ReconcilePlan) -> list[dict[str, Any]]:
    return [o for o in plan.create if o["kind"] == "Pod"]


def running(pod: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["spec"]["nodeName"] = "n1"
    out["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    return out


def world(body: dict[str, Any], controller: dict[str, Any] | None = None) -> Observed:
    plan = run(body, controller=controller)
    body["status"] = plan.status
    objs = {(o["kind"], o["metadata"]["name"]): o for o in plan.create if o["kind"] != "Pod"}
    return Observed(
        pods=[running(p) for p in pods(plan)],
        service=objs["Service", "demo-agents"],
        controller=objs["Deployment", "demo-controller"],
        pdb=objs["PodDisruptionBudget", "demo-agents"],
        metrics_service=objs["Service", "demo-metrics"],
    )


def replicas(plan: ReconcilePlan, observed: Observed) -> int:
    changed = [o for o in plan.apply + plan.create if o["kind"] == "Deployment"]
    deployment = changed[0] if changed else observed.controller
    assert deployment is not None
    return int(deployment["spec"]["replicas"])


# --------------------------------------------------------------------------- suspend


def test_a_suspended_job_creates_no_pods_and_no_running_controller() -> None:
    plan = run(job(suspend=True))
    assert pods(plan) == []
    (deployment,) = [o for o in plan.create if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 0
    assert plan.status["phase"] == "Suspended" and plan.status["desiredPods"] == 0
    (cond,) = [c for c in plan.status["conditions"] if c["type"] == "Suspended"]
    assert cond["status"] == "True"


def terminating(pod: dict[str, Any], at: datetime) -> dict[str, Any]:
    """``pod`` being deleted: the API server set its deletionTimestamp (request + grace)."""
    out = copy.deepcopy(pod)
    out["metadata"]["deletionTimestamp"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
    return out


def test_suspending_keeps_the_controller_until_the_pods_have_saved_and_gone() -> None:
    body = job()
    observed = world(body, {"phase": "Running", "step": 40})
    body["spec"]["suspend"] = True
    plan = run(body, observed, {"phase": "Running", "step": 40})
    assert sorted(d.name for d in plan.delete) == ["demo-agent-0", "demo-agent-1", "demo-agent-2"]
    assert {d.reason for d in plan.delete} == {"job suspended"}
    # the agents' preStop hooks ask the controller for a checkpoint: it must stay
    assert replicas(plan, observed) == 1
    assert not [d for d in plan.delete if d.kind != "Pod"]  # Services, budget, job: kept
    assert plan.status["step"] == 40  # the job's state is still read and shown
    assert plan.status["phase"] == "Suspended" and plan.status["desiredPods"] == 0
    (cond,) = [c for c in plan.status["conditions"] if c["type"] == "Suspended"]
    assert cond["status"] == "True" and "3 agent pod(s) are saving a checkpoint" in cond["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "Suspended")]
    body["status"] = plan.status
    # the pods terminate (within their grace period); the controller saw nodes leave
    grace = NOW + timedelta(seconds=35)
    observed.pods = [terminating(p, grace) for p in observed.pods]
    leaving = {
        "phase": "Recovering",
        "step": 41,
        "failed_nodes": ["demo-agent-0"],
        "recoveries": 1,
        "last_checkpoint": "s3://b/demo/step-00000041",
    }
    plan = run(body, observed, leaving, now=NOW + timedelta(seconds=3))
    assert plan.delete == [] and pods(plan) == []
    assert replicas(plan, observed) == 1
    assert plan.status["phase"] == "Suspended" and plan.status["step"] == 41
    # a checkpoint is news; nodes the controller saw leave are not failures
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "Checkpoint")]
    body["status"] = plan.status
    # one pod is gone, one is past its grace period (its node is unreachable): the
    # third still counts
    observed.pods = observed.pods[1:]
    observed.pods[0]["metadata"]["deletionTimestamp"] = "2026-01-02T03:04:06Z"
    plan = run(body, observed, leaving, now=NOW + timedelta(seconds=10))
    assert replicas(plan, observed) == 1
    (cond,) = [c for c in plan.status["conditions"] if c["type"] == "Suspended"]
    assert "1 agent pod(s) are saving a checkpoint" in cond["message"]
    # the last one is gone: the controller is scaled to zero
    observed.pods = observed.pods[:1]
    plan = run(body, observed, leaving, now=NOW + timedelta(seconds=12))
    assert replicas(plan, observed) == 0
    (cond,) = [c for c in plan.status["conditions"] if c["type"] == "Suspended"]
    assert cond["message"] == "spec.suspend is true: no pods run; the job's state is kept"
    assert plan.events == []
    body["status"] = plan.status
    observed.pods = []
    observed.controller = next(o for o in plan.apply if o["kind"] == "Deployment")
    # resume: the pods come back under new names, the controller runs again
    body["spec"]["suspend"] = False
    plan = run(body, observed, leaving)
    assert [p["metadata"]["name"] for p in pods(plan)] == [
        "demo-agent-3",
        "demo-agent-4",
        "demo-agent-5",
    ]
    assert replicas(plan, observed) == 1
    # the controller's record says Recovering (its nodes left); resuming is no failure
    assert plan.status["phase"] == "Recovering"
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "Resumed")]


def test_a_job_suspended_before_it_had_pods_stops_its_controller_at_once() -> None:
    body = job()
    observed = world(body)
    observed.pods = []
    body["spec"]["suspend"] = True
    plan = run(body, observed)
    assert replicas(plan, observed) == 0 and plan.delete == []


def test_a_finished_job_scales_its_controller_down_with_its_pods() -> None:
    # nothing to save once the job is over: the controller goes in the same round
    body = job(suspend=True)
    observed = world(job())
    plan = run(body, observed, {"phase": "Succeeded", "step": 100})
    assert replicas(plan, observed) == 0
    assert {d.reason for d in plan.delete} == {"job finished"}
    assert plan.status["phase"] == "Succeeded"


def test_suspend_through_the_handler_keeps_the_job_in_etcd() -> None:
    kube, records = FakeKube(), FakeRecords()
    runtime = Runtime(kube=kube, records=records, settings=SETTINGS, clock=lambda: NOW)
    memo = kopf.Memo(runtime=runtime)
    body = job()
    patch = kopf.Patch()
    handlers.on_spec(body=body, memo=memo, patch=patch)
    assert kube.pods() == ["demo-agent-0", "demo-agent-1", "demo-agent-2"]
    body["status"] = dict(patch["status"])
    body["spec"]["suspend"] = True
    patch = kopf.Patch()
    handlers.on_spec(body=body, memo=memo, patch=patch)
    assert kube.pods() == []
    assert patch["status"]["phase"] == "Suspended"
    assert records.forgotten == [] and "demo" in records.specs
    assert ("ml", "Service", "demo-agents") in kube.objects
    assert ("demo", "Normal", "Suspended") in [e[:3] for e in kube.events]


# --------------------------------------------------------------------------- TTL


def test_ttl_deletes_the_trainingjob_once_it_has_passed() -> None:
    body = job(ttlSecondsAfterFinished=600)
    observed = world(body)
    done = {"phase": "Succeeded", "step": 1000}
    plan = run(body, observed, done)
    assert plan.status["completionTime"] == "2026-01-02T03:04:05Z"
    assert not [d for d in plan.delete if d.kind == "TrainingJob"]
    body["status"] = plan.status
    later = run(body, observed, done, now=NOW + timedelta(seconds=599))
    assert later.status["completionTime"] == "2026-01-02T03:04:05Z"  # kept, not moved
    assert not [d for d in later.delete if d.kind == "TrainingJob"]
    expired = run(body, observed, done, now=NOW + timedelta(seconds=600))
    (gone,) = [d for d in expired.delete if d.kind == "TrainingJob"]
    assert gone.name == "demo" and "ttlSecondsAfterFinished (600s)" in gone.reason
    assert ("Normal", "Expired") in [(e.type, e.reason) for e in expired.events]


def test_without_ttl_a_finished_job_stays() -> None:
    body = job()
    observed = world(body)
    body["status"] = run(body, observed, {"phase": "Failed"}).status
    plan = run(body, observed, {"phase": "Failed"}, now=NOW + timedelta(days=365))
    assert not [d for d in plan.delete if d.kind == "TrainingJob"]


def test_a_rerun_clears_the_completion_time() -> None:
    body = job()
    body["status"] = run(body, None, {"phase": "Succeeded"}).status
    plan = run(body, None, {"phase": "Running"})
    assert plan.status["completionTime"] is None  # a merge patch with null removes it


def test_ttl_through_the_handler_deletes_the_job() -> None:
    kube, records = FakeKube(), FakeRecords()
    runtime = Runtime(kube=kube, records=records, settings=SETTINGS, clock=lambda: NOW)
    body = job(ttlSecondsAfterFinished=0)
    kube.jobs[("ml", "demo")] = body
    records.statuses["demo"] = {"phase": "Succeeded", "step": 5}
    patch = kopf.Patch()
    handlers.on_timer(body=body, memo=kopf.Memo(runtime=runtime), patch=patch)
    assert ("ml", "demo") not in kube.jobs


# --------------------------------------------------------------------------- events


def test_events_for_a_failed_pod_a_recovery_a_checkpoint_and_the_end() -> None:
    body = job()
    observed = world(body, {"phase": "Running", "step": 10})
    failed = observed.pods[0]
    failed["status"] = {"phase": "Failed", "reason": "Evicted"}
    recovering = {
        "phase": "Recovering",
        "step": 10,
        "failed_nodes": ["demo-agent-0"],
        "message": "demo-agent-0 gone (agent_gone)",
    }
    plan = run(body, observed, recovering)
    reasons = [(e.type, e.reason) for e in plan.events]
    assert reasons == [
        ("Warning", "PodFailed"),
        ("Warning", "NodeFailed"),
        ("Warning", "Recovering"),
    ]
    assert "demo-agent-0: pod failed (Evicted)" in plan.events[0].message
    assert plan.events[2].message == "demo-agent-0 gone (agent_gone)"
    body["status"] = plan.status
    trained = {
        "phase": "Running",
        "step": 12,
        "world_size": 2,
        "recoveries": 1,
        "failed_nodes": ["demo-agent-0"],
        "last_checkpoint": "s3://b/demo/step-00000012",
    }
    observed.pods = observed.pods[1:]
    plan = run(body, observed, trained)
    assert [(e.type, e.reason) for e in plan.events] == [
        ("Normal", "Recovered"),
        ("Normal", "Checkpoint"),
    ]
    assert plan.events[1].message == "committed s3://b/demo/step-00000012"
    body["status"] = plan.status
    assert run(body, observed, trained).events == []  # nothing new: nothing posted
    failed_job = {**trained, "phase": "Failed", "message": "max_restarts (3) reached"}
    (event,) = run(body, observed, failed_job).events
    assert (event.type, event.reason) == ("Warning", "Failed")
    assert "max_restarts (3) reached" in event.message


# --------------------------------------------------------------------------- metrics


def test_the_controller_serves_metrics_behind_a_service() -> None:
    plan = run(job())
    (deployment,) = [o for o in plan.create if o["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[command.index("--metrics-port") + 1] == "9400"
    assert command[command.index("--metrics-host") + 1] == "0.0.0.0"
    (port,) = container["ports"]
    (service,) = [o for o in plan.create if o["metadata"]["name"] == "demo-metrics"]
    (svc_port,) = service["spec"]["ports"]
    assert svc_port["targetPort"] == port["name"] == "metrics"
    assert svc_port["port"] == port["containerPort"] == 9400
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    # the ServiceMonitor in k8s/monitoring selects it by these labels
    assert service["metadata"]["labels"]["app.kubernetes.io/component"] == "controller"
    for obj in (service, deployment):
        assert kubernetes_validate.validate(obj, "1.37.0", strict=True) == "1.37"


# --------------------------------------------------------------------------- over HTTP


def test_events_ttl_and_topology_labels_over_http() -> None:
    """KubeClient against the HTTP fake of the API server: the paths and bodies it sends."""
    with FakeApiServer() as api:
        kube = KubeClient.for_host(api.url)
        try:
            runtime = Runtime(
                kube=kube, records=FakeRecords(), settings=SETTINGS, clock=lambda: NOW
            )
            memo = kopf.Memo(runtime=runtime)
            body = job(ttlSecondsAfterFinished=0)
            api.put("ml", "trainingjobs", body)
            handlers.on_spec(body=body, memo=memo, patch=kopf.Patch())
            pod = api.get("ml", "pods", "demo-agent-0")
            assert pod is not None
            pod["spec"]["nodeName"] = "gpu-7"
            api.put(
                "",
                "nodes",
                {
                    "metadata": {
                        "name": "gpu-7",
                        "labels": {
                            "topology.kubernetes.io/zone": "z1",
                            "topology.ringmaster.dev/rack": "r3",
                            "kubernetes.io/hostname": "gpu-7",
                        },
                    }
                },
            )
            handlers.on_agent_pod(event={"type": "MODIFIED"}, body=pod, memo=memo)
            stored = api.get("ml", "pods", "demo-agent-0")
            assert stored is not None
            labels = stored["metadata"]["labels"]
            assert labels["ringmaster.dev/rack"] == "r3" and labels["ringmaster.dev/zone"] == "z1"
            assert labels["ringmaster.dev/host"] == "gpu-7"
            # the job finishes: an event is posted and the TTL (0 s) deletes the TrainingJob
            assert isinstance(runtime.records, FakeRecords)
            runtime.records.statuses["demo"] = {"phase": "Failed", "message": "boom"}
            handlers.on_timer(body=body, memo=memo, patch=kopf.Patch())
            assert api.get("ml", "trainingjobs", "demo") is None
            events = [o for (_, r, _), o in api.objects.items() if r == "events"]
            reasons = {e["reason"] for e in events}
            assert {"Failed", "Expired"} <= reasons
            failed = next(e for e in events if e["reason"] == "Failed")
            assert failed["type"] == "Warning" and "boom" in failed["message"]
            assert kubernetes_validate.validate(failed, "1.37.0", strict=True) == "1.37"
            assert failed["involvedObject"] == {
                "apiVersion": "ringmaster.dev/v1alpha1",
                "kind": "TrainingJob",
                "name": "demo",
                "namespace": "ml",
                "uid": "uid-1",
            }
            assert ("DELETE", "/apis/ringmaster.dev/v1alpha1/namespaces/ml/trainingjobs/demo") in {
                (m, p) for (m, p, _) in api.requests
            }
        finally:
            kube.api_client.close()


def test_a_pod_the_api_server_refuses_shows_in_the_status() -> None:
    """A bad free-form template part (here: a refused pod) is reported, over HTTP to the fake."""
    with FakeApiServer() as api:
        kube = KubeClient.for_host(api.url)
        try:
            runtime = Runtime(
                kube=kube, records=FakeRecords(), settings=SETTINGS, clock=lambda: NOW
            )
            body = job(template={"spec": {"volumes": [{"name": "data", "nfs": {}}]}})
            api.put("ml", "trainingjobs", body)
            api.errors[("POST", "pods")] = 422
            patch = kopf.Patch()
            with pytest.raises(kopf.PermanentError):
                handlers.on_spec(body=body, memo=kopf.Memo(runtime=runtime), patch=patch)
            status = patch["status"]
            assert status["phase"] == "Invalid"
            assert status["message"].startswith("Pod demo-agent-0: the Kubernetes API refused it")
            assert "spec.template" in status["message"]
            events = [o for (_, r, _), o in api.objects.items() if r == "events"]
            assert [e["reason"] for e in events] == ["InvalidSpec"]
        finally:
            kube.api_client.close()


def test_suspend_over_http_keeps_the_controller_until_the_kubelet_is_done() -> None:
    """The handlers over real HTTP to the fake API server, deleting pods gracefully."""
    with FakeApiServer() as api:
        kube = KubeClient.for_host(api.url)
        try:
            api.graceful_pods = True
            api.clock = lambda: NOW
            records = FakeRecords()
            runtime = Runtime(kube=kube, records=records, settings=SETTINGS, clock=lambda: NOW)
            memo = kopf.Memo(runtime=runtime)
            body = job()
            api.put("ml", "trainingjobs", body)
            handlers.on_spec(body=body, memo=memo, patch=kopf.Patch())
            for name in api.names("pods"):
                pod = api.get("ml", "pods", name)
                assert pod is not None
                api.put("ml", "pods", running(pod))
            records.statuses["demo"] = {"phase": "Running", "step": 40}

            def replicas_now() -> int:
                deployment = api.get("ml", "deployments", "demo-controller")
                assert deployment is not None
                return int(deployment["spec"]["replicas"])

            assert replicas_now() == 1
            body["spec"]["suspend"] = True
            patch = kopf.Patch()
            handlers.on_spec(body=body, memo=memo, patch=patch)
            assert patch["status"]["phase"] == "Suspended"
            pods = [api.get("ml", "pods", n) for n in api.names("pods")]
            assert len(pods) == 3 and all(
                p is not None and p["metadata"]["deletionTimestamp"] == "2026-01-02T03:04:50Z"
                for p in pods
            )  # NOW + the grace period (30 s preemption grace + 15 s margin)
            assert replicas_now() == 1  # the agents' checkpoint requests need it
            # the kubelet finishes two pods; a pod event re-syncs: the controller stays
            body["status"] = patch["status"]
            api.put("ml", "trainingjobs", body)
            gone = api.finish_deletion("ml", "demo-agent-0")
            api.finish_deletion("ml", "demo-agent-1")
            handlers.on_agent_pod(event={"type": "DELETED"}, body=gone, memo=memo)
            assert replicas_now() == 1
            # the last one goes: now the controller is scaled to zero
            gone = api.finish_deletion("ml", "demo-agent-2")
            handlers.on_agent_pod(event={"type": "DELETED"}, body=gone, memo=memo)
            assert replicas_now() == 0
            stored = api.get("ml", "trainingjobs", "demo")
            assert stored is not None and stored["status"]["phase"] == "Suspended"
            assert records.forgotten == [] and "demo" in records.specs
        finally:
            kube.api_client.close()
