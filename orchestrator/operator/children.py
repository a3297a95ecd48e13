"""The non-pod children of a TrainingJob: headless Service, controller, disruption budget.

* **Service** ``<job>-agents``: headless (``clusterIP: None``) and publishing
  not-ready addresses, so every agent pod has a DNS name from the moment it
  starts, before it is registered (rendezvous needs it then).
* **Controller** ``<job>-controller``: a one-replica Deployment running
  ``ringmaster controller --job NAME --etcd ...``.  A Deployment (not a bare
  pod) so a lost machine does not lose the controller; two replicas for a
  moment during a rollout are harmless because controllers elect a leader
  through an etcd lease.  Once the job is finished it is scaled to zero, so
  the exiting controller is not restarted forever; a suspended job's once its
  agent pods, which need it to relay their checkpoint request, are gone.
  It gets the pod template's scheduling fields
  (:func:`.template.controller_scheduling`).
* **Service** ``<job>-metrics``: the controller's Prometheus endpoint (port
  ``metrics``, 9400), labelled like the controller
  (``app.kubernetes.io/component: controller``) so one ServiceMonitor
  (``k8s/monitoring/``) finds every job's.
* **PodDisruptionBudget** ``<job>-agents``: ``minAvailable: nodes.min``, so a
  voluntary disruption (node drain, cluster upgrade) never takes the job
  below the size it can train at; pods that are not ready may always be
  evicted (``unhealthyPodEvictionPolicy: AlwaysAllow``) so a broken pod never
  blocks a drain.
"""

from __future__ import annotations

from typing import Any

from orchestrator.operator.api import (
    LABEL_JOB,
    LABEL_ROLE,
    METRICS_PORT,
    METRICS_PORT_NAME,
    ROLE_AGENT,
    ROLE_CONTROLLER,
    OperatorSettings,
)
from orchestrator.operator.etcd_access import etcd_env, etcd_mounts, etcd_volumes
from orchestrator.operator.meta import (
    agent_selector,
    child_meta,
    controller_name,
    labels,
    metrics_service_name,
    pdb_name,
    service_name,
)
from orchestrator.operator.pods import container_security, pod_security
from orchestrator.spec.job import JobSpec


def controller_command(spec: JobSpec, endpoints: tuple[str, ...]) -> list[str]:
    """The controller's command line; every option is one ``ringmaster controller`` accepts.

    Metrics are served on every interface of the pod, for the metrics Service.
    """
    return [
        "ringmaster",
        "controller",
        "--job",
        spec.name,
        "--etcd",
        ",".join(endpoints),
        "--metrics-port",
        str(METRICS_PORT),
        "--metrics-host",
        "0.0.0.0",
    ]


def metrics_service(body: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """The Service in front of the controller's Prometheus endpoint."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(body, metrics_service_name(spec.name), ROLE_CONTROLLER),
        "spec": {
            "selector": {LABEL_JOB: spec.name, LABEL_ROLE: ROLE_CONTROLLER},
            "ports": [
                {
                    "name": METRICS_PORT_NAME,
                    "port": METRICS_PORT,
                    "targetPort": METRICS_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def headless_service(body: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """The headless Service that gives agent pods stable DNS names."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(body, service_name(spec.name), ROLE_AGENT),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": agent_selector(spec.name),
        },
    }


def controller_deployment(
    body: dict[str, Any],
    spec: JobSpec,
    endpoints: tuple[str, ...],
    *,
    cpu: str,
    memory: str,
    running: bool = True,
    service_account: str = "",
    settings: OperatorSettings | None = None,
    scheduling: dict[str, Any] | None = None,
    password: dict[str, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The job's controller, one replica while the job runs, zero once it is finished
    (or suspended).

    ``settings`` adds the operator's etcd TLS Secret, user and password Secret
    (:mod:`orchestrator.operator.etcd_access`); ``scheduling`` are the pod
    template's scheduling fields (:func:`.template.controller_scheduling`: node
    selection, tolerations, registry secrets, priority), so the controller runs
    wherever the agents may; ``password``: where the template's agent container gets
    the job's ``rendezvous.password_env`` (:func:`.template.password_source`).
    """
    pod_labels = labels(spec.name, ROLE_CONTROLLER)
    password = password or {}
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        *etcd_env(spec, settings),
        *password.get("env", []),
    ]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(),
        "containers": [
            {
                "name": "controller",
                "image": spec.resources.image,
                "imagePullPolicy": "IfNotPresent",
                "command": controller_command(spec, endpoints),
                "env": env,
                **({"envFrom": password["envFrom"]} if password.get("envFrom") else {}),
                "ports": [
                    {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"}
                ],
                "resources": {
                    "requests": {"cpu": cpu, "memory": memory},
                    "limits": {"memory": memory},
                },
                "securityContext": container_security(),
                "volumeMounts": [
                    {"name": "tmp", "mountPath": "/tmp"},
                    *etcd_mounts(settings),
                ],
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}, *etcd_volumes(settings)],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    pod_spec.update(scheduling or {})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_meta(body, controller_name(spec.name), ROLE_CONTROLLER),
        "spec": {
            "replicas": 1 if running else 0,
            "selector": {"matchLabels": {LABEL_JOB: spec.name, LABEL_ROLE: ROLE_CONTROLLER}},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def disruption_budget(body: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """The PodDisruptionBudget of the agent pods."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_meta(body, pdb_name(spec.name), ROLE_AGENT),
        "spec": {
            "minAvailable": spec.nodes.min,
            "selector": {"matchLabels": agent_selector(spec.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
