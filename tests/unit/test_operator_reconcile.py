"""The pure reconcile function: TrainingJob + observed children → plan and status."""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any

import kubernetes_validate
import pytest

from orchestrator.operator.api import (
    ANN_TEMPLATE_HASH,
    GPU_RESOURCE,
    Observed,
    OperatorSettings,
    PermanentOperatorError,
    ReconcilePlan,
)
from orchestrator.operator.reconcile import contains, reconcile
from orchestrator.spec.api import SpecError

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
SETTINGS = OperatorSettings(etcd_endpoints=("etcd-0:2379", "etcd-1:2379"))


def job(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "entrypoint": {"script": "train.py"},
        "nodes": {"min": 2, "max": 3, "spares": 1},
        "fault_tolerance": {"preemption_grace": "45s"},
        "resources": {"image": "reg/ringmaster:1", "cpu": "2", "memory": "4Gi"},
    }
    base.update(spec)
    return {
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1", "generation": 3},
        "spec": base,
        "status": {},
    }


def run(
    body: dict[str, Any],
    observed: Observed | None = None,
    controller: dict[str, Any] | None = None,
) -> ReconcilePlan:
    return reconcile(body, observed or Observed(), controller, SETTINGS, NOW)


def created(plan: ReconcilePlan, kind: str) -> list[dict[str, Any]]:
    return [o for o in plan.create if o["kind"] == kind]


def running(pod: dict[str, Any], *, ready: bool = True, node: str = "n1") -> dict[str, Any]:
    """A pod as the API server would report it once scheduled and started."""
    out = copy.deepcopy(pod)
    out["spec"]["nodeName"] = node
    out["status"] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    return out


def world(body: dict[str, Any]) -> Observed:
    """Everything the first reconcile creates, now running and ready."""
    plan = run(body)
    objs = {(o["kind"], o["metadata"]["name"]): o for o in plan.create if o["kind"] != "Pod"}
    pods = [running(p, node=f"n{i}") for i, p in enumerate(created(plan, "Pod"))]
    body["status"] = plan.status
    return Observed(
        pods=pods,
        service=objs["Service", "demo-agents"],
        controller=objs["Deployment", "demo-controller"],
        pdb=objs["PodDisruptionBudget", "demo-agents"],
        metrics_service=objs["Service", "demo-metrics"],
    )


def names(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


# --------------------------------------------------------------------------- create


def test_create_makes_every_child_with_an_owner_reference() -> None:
    plan = run(job())
    kinds = sorted(o["kind"] for o in plan.create)
    assert kinds == [
        "Deployment",
        "Pod",
        "Pod",
        "Pod",
        "Pod",
        "PodDisruptionBudget",
        "Service",
        "Service",
    ]
    for obj in plan.create:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "ringmaster.dev/v1alpha1",
            "kind": "TrainingJob",
            "name": "demo",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"]["ringmaster.dev/job"] == "demo"
    assert plan.delete == [] and plan.apply == []


def test_every_child_is_valid_kubernetes() -> None:
    for obj in run(job(resources={"gpus": 2})).create:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)


def test_pod_count_is_max_plus_spares_with_distinct_names() -> None:
    pods = created(run(job(nodes={"min": 1, "max": 5, "spares": 2})), "Pod")
    assert names(pods) == [f"demo-agent-{i}" for i in range(7)]


def agent_argv(pod: dict[str, Any]) -> list[str]:
    """The agent's argv inside the launch script (``sh -c SCRIPT NAME ARGV...``)."""
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["/bin/sh", "-c"] and 'exec "$@"' in command[2]
    return list(command[4:])


def test_agent_command_and_etcd() -> None:
    pod = created(run(job()), "Pod")[0]
    assert agent_argv(pod) == [
        "ringmaster",
        "agent",
        "--job",
        "demo",
        "--etcd",
        "etcd-0:2379,etcd-1:2379",
    ]
    assert pod["spec"]["containers"][0]["image"] == "reg/ringmaster:1"


def test_launch_script_exports_the_topology_labels() -> None:
    script = created(run(job()), "Pod")[0]["spec"]["containers"][0]["command"][2]
    assert "python -m orchestrator.operator.topology" in script
    assert "export RINGMASTER_LABELS" in script


def test_job_endpoints_win_over_the_operator_etcd() -> None:
    body = job(rendezvous={"endpoints": ["my-etcd:2379"]})
    pod = created(run(body), "Pod")[0]
    assert agent_argv(pod)[-1] == "my-etcd:2379"
    deployment = created(run(body), "Deployment")[0]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "ringmaster",
        "controller",
        "--job",
        "demo",
        "--etcd",
        "my-etcd:2379",
        "--metrics-port",
        "9400",
        "--metrics-host",
        "0.0.0.0",
    ]


def test_no_etcd_anywhere_is_permanent() -> None:
    with pytest.raises(PermanentOperatorError, match="RINGMASTER_ETCD"):
        reconcile(job(), Observed(), None, OperatorSettings(), NOW)


def test_invalid_spec_raises_spec_error() -> None:
    with pytest.raises(SpecError, match=r"nodes\.min \(3\) is larger"):
        run(job(nodes={"min": 3, "max": 1}))


def test_agent_env_from_the_downward_api() -> None:
    pod = created(run(job()), "Pod")[0]
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # the agent's --node and --address, by their environment fallbacks
    assert env["RINGMASTER_NODE"]["value"] == "$(POD_NAME)"
    assert env["RINGMASTER_ADDRESS"]["value"] == "$(POD_IP)"
    assert env["RINGMASTER_JOB"]["value"] == "demo"
    assert env["RINGMASTER_ETCD"]["value"] == "etcd-0:2379,etcd-1:2379"
    assert env["RINGMASTER_TOPOLOGY_FILE"]["value"] == "/etc/ringmaster/podinfo/annotations"
    assert env["RINGMASTER_DRAIN_TIMEOUT"]["value"] == "45"  # the preemption grace
    # $(VAR) references only work for variables defined earlier in the list
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert names.index("POD_NAME") < names.index("RINGMASTER_NODE")
    assert names.index("POD_IP") < names.index("RINGMASTER_ADDRESS")
    # the topology file is the pod's annotations through a downward-API volume
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    items = volumes["podinfo"]["downwardAPI"]["items"]
    assert {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}} in items


def test_etcd_tls_and_user_reach_the_agent_as_env() -> None:
    body = job(rendezvous={"tls": {"ca_cert": "/etc/etcd/ca.pem"}, "user": "trainer"})
    env = {
        e["name"]: e.get("value")
        for e in created(run(body), "Pod")[0]["spec"]["containers"][0]["env"]
    }
    assert env["RINGMASTER_ETCD_CA"] == "/etc/etcd/ca.pem"
    assert env["RINGMASTER_ETCD_USER"] == "trainer"


def test_probes_prestop_and_grace_period() -> None:
    pod = created(run(job()), "Pod")[0]
    (container,) = pod["spec"]["containers"]
    probe = ["python", "-m", "orchestrator.operator.probe"]
    assert container["readinessProbe"]["exec"]["command"] == [*probe, "ready"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [*probe, "drain"]
    # preemption_grace 45 s + 15 s margin
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60
    assert pod["spec"]["restartPolicy"] == "OnFailure"


def test_fractional_grace_rounds_up() -> None:
    pod = created(run(job(fault_tolerance={"preemption_grace": "1500ms"})), "Pod")[0]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 17


def test_resources_cpu_and_gpu() -> None:
    cpu_pod = created(run(job()), "Pod")[0]
    res = cpu_pod["spec"]["containers"][0]["resources"]
    assert res == {
        "requests": {"cpu": "2", "memory": "4Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }
    assert "tolerations" not in cpu_pod["spec"]
    gpu_pod = created(run(job(resources={"gpus": 8, "cpu": "32", "memory": "200Gi"})), "Pod")[0]
    res = gpu_pod["spec"]["containers"][0]["resources"]
    assert res["limits"][GPU_RESOURCE] == 8 and res["requests"][GPU_RESOURCE] == 8
    assert gpu_pod["spec"]["tolerations"][0]["key"] == GPU_RESOURCE


def test_security_context_is_non_root() -> None:
    pod = created(run(job()), "Pod")[0]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == 1000
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_topology_spread_and_headless_service() -> None:
    plan = run(job())
    pod = created(plan, "Pod")[0]
    spread = pod["spec"]["topologySpreadConstraints"]
    # machines first, then every configured rack label, then zones: spares land in other racks
    assert [c["topologyKey"] for c in spread] == [
        "kubernetes.io/hostname",
        *SETTINGS.rack_labels,
        *SETTINGS.zone_labels,
    ]
    for c in spread:
        assert c["whenUnsatisfiable"] == "ScheduleAnyway" and c["maxSkew"] == 1
        assert c["labelSelector"]["matchLabels"] == {
            "ringmaster.dev/job": "demo",
            "ringmaster.dev/role": "agent",
        }
    (svc,) = [s for s in created(plan, "Service") if s["metadata"]["name"] == "demo-agents"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"]


def test_pdb_keeps_the_minimum() -> None:
    (pdb,) = created(run(job()), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"]["ringmaster.dev/role"] == "agent"


# --------------------------------------------------------------------------- steady state


def test_steady_state_changes_nothing() -> None:
    body = job()
    observed = world(body)
    plan = run(body, observed)
    assert plan.empty, (plan.create, plan.apply, plan.delete)
    assert plan.status["readyPods"] == 4 and plan.status["desiredPods"] == 4


def test_server_defaults_are_not_differences() -> None:
    assert contains({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": 2}})
    assert not contains({"a": [1, 2]}, {"a": [1]})
    assert not contains({"b": {"c": 2}}, {"b": {"c": 3}})


def test_foreign_pods_are_ignored() -> None:
    body = job()
    observed = world(body)
    stray = copy.deepcopy(observed.pods[0])
    stray["metadata"]["name"] = "demo-agent-99"
    stray["metadata"]["ownerReferences"][0]["uid"] = "old-uid"
    observed.pods.append(stray)
    assert run(body, observed).empty


# --------------------------------------------------------------------------- failures


def test_failed_pod_is_deleted_and_replaced_under_a_new_name() -> None:
    body = job()
    observed = world(body)
    observed.pods[1]["status"] = {"phase": "Failed", "reason": "Evicted"}
    plan = run(body, observed)
    assert [(d.kind, d.name) for d in plan.delete] == [("Pod", "demo-agent-1")]
    assert "Evicted" in plan.delete[0].reason
    assert names(created(plan, "Pod")) == ["demo-agent-4"]
    assert plan.status["replacedPods"] == 1
    assert plan.status["nextPodIndex"] == 5


def test_terminating_pod_is_replaced_at_once() -> None:
    body = job()
    observed = world(body)
    observed.pods[2]["metadata"]["deletionTimestamp"] = "2026-01-02T03:04:00Z"
    plan = run(body, observed)
    assert plan.delete == []  # already going
    assert names(created(plan, "Pod")) == ["demo-agent-4"]


def test_indices_never_go_back() -> None:
    body = job()
    observed = world(body)
    body["status"]["nextPodIndex"] = 10
    observed.pods.pop()  # fully gone
    assert names(created(run(body, observed), "Pod")) == ["demo-agent-10"]


def test_unknown_phase_pods_still_count() -> None:
    body = job()
    observed = world(body)
    observed.pods[0]["status"]["phase"] = "Unknown"
    assert created(run(body, observed), "Pod") == []


# --------------------------------------------------------------------------- scaling


def test_scale_up_adds_pods() -> None:
    body = job()
    observed = world(body)
    body["spec"]["nodes"]["max"] = 5
    plan = run(body, observed)
    assert names(created(plan, "Pod")) == ["demo-agent-4", "demo-agent-5"]
    assert plan.delete == []


def test_scale_down_removes_spares_before_active_nodes() -> None:
    body = job()
    observed = world(body)
    body["spec"]["nodes"] = {"min": 1, "max": 2, "spares": 0}
    controller = {
        "phase": "Running",
        "active_nodes": ["demo-agent-1", "demo-agent-2", "demo-agent-3"],
        "spare_nodes": ["demo-agent-0"],
    }
    plan = run(body, observed, controller)
    # the spare first, then the highest index among the active ones
    assert [d.name for d in plan.delete] == ["demo-agent-0", "demo-agent-3"]
    assert all(d.reason == "scaled down" for d in plan.delete)
    assert created(plan, "Pod") == []


def test_scale_down_removes_unscheduled_pods_first() -> None:
    body = job()
    observed = world(body)
    pending = observed.pods[0]
    pending["spec"].pop("nodeName")
    pending["status"] = {"phase": "Pending"}
    body["spec"]["nodes"]["max"] = 2
    plan = run(body, observed)
    assert [d.name for d in plan.delete] == ["demo-agent-0"]


def test_spec_change_updates_the_pdb() -> None:
    body = job()
    observed = world(body)
    body["spec"]["nodes"]["min"] = 3
    plan = run(body, observed)
    (pdb,) = plan.apply
    assert pdb["kind"] == "PodDisruptionBudget" and pdb["spec"]["minAvailable"] == 3


def test_template_change_rolls_one_pod_at_a_time_spares_first() -> None:
    body = job()
    observed = world(body)
    body["spec"]["resources"]["image"] = "reg/ringmaster:2"
    controller = {"phase": "Running", "spare_nodes": ["demo-agent-2"]}
    plan = run(body, observed, controller)
    assert [d.name for d in plan.delete] == ["demo-agent-2"]
    (new,) = created(plan, "Pod")
    assert new["spec"]["containers"][0]["image"] == "reg/ringmaster:2"
    assert any(o["kind"] == "Deployment" for o in plan.apply)
    # while the replacement is not ready, nothing else rolls
    observed.pods = [p for p in observed.pods if p["metadata"]["name"] != "demo-agent-2"]
    observed.pods.append(running(new, ready=False))
    body["status"] = plan.status
    plan = run(body, observed, controller)
    assert plan.delete == [] and created(plan, "Pod") == []
    # once it is ready, the next one goes
    observed.pods[-1] = running(new, ready=True)
    plan = run(body, observed, controller)
    assert len(plan.delete) == 1 and plan.delete[0].reason == "pod spec changed"
    assert (
        observed.pods[-1]["metadata"]["annotations"][ANN_TEMPLATE_HASH]
        != (observed.pods[0]["metadata"]["annotations"][ANN_TEMPLATE_HASH])
    )


# --------------------------------------------------------------------------- the end


def test_terminal_phase_stops_everything() -> None:
    body = job()
    observed = world(body)
    plan = run(body, observed, {"phase": "Succeeded", "step": 1000})
    assert sorted(d.name for d in plan.delete) == names(observed.pods)
    assert all(d.reason == "job finished" for d in plan.delete)
    assert created(plan, "Pod") == []
    (deployment,) = plan.apply
    assert deployment["kind"] == "Deployment" and deployment["spec"]["replicas"] == 0
    assert plan.status["phase"] == "Succeeded"


def test_a_succeeded_agent_means_no_more_pods() -> None:
    body = job()
    observed = world(body)
    observed.pods[0]["status"] = {"phase": "Succeeded"}
    observed.pods.pop()
    plan = run(body, observed, {"phase": "Running"})
    assert created(plan, "Pod") == [] and plan.delete == []


def test_deleted_job_children_need_no_work() -> None:
    """Deletion is the garbage collector's: every child points at the TrainingJob."""
    body = job()
    observed = world(body)
    for obj in [*observed.pods, observed.service, observed.controller, observed.pdb]:
        assert obj is not None
        assert obj["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
