"""The agent pod of a TrainingJob, rendered as a plain dict.

One pod runs one ``ringmaster agent`` (one node of the job).  The pods are
created and deleted by the operator directly rather than through a
StatefulSet: any agent pod can be active or spare (the controller decides,
from registrations in etcd), so when the job shrinks the operator must pick
*which* pod goes (a spare or an unscheduled pod, never an arbitrary
highest ordinal), and a failed pod must be replaced by a fresh one under a new
name at once, not recreated under the same name after the old one is gone.

What the pod gives the agent (``ringmaster agent`` reads these options from
its ``RINGMASTER_*`` environment fallbacks):

* command ``ringmaster agent --job NAME --etcd HOST:PORT[,...]``, started
  through ``sh -c`` only to add ``RINGMASTER_LABELS`` first, then ``exec``-ed
  so the agent is PID 1 and receives SIGTERM itself;
* ``RINGMASTER_NODE`` = the pod name (the node id it registers under, so the
  controller's ``active_nodes`` are pod names) and ``RINGMASTER_ADDRESS`` = the
  pod IP (where peers reach its workers);
* ``RINGMASTER_LABELS`` = ``host=<NODE_NAME>,zone=...,rack=...``: ``NODE_NAME``
  comes from the downward API; zone and rack from the Node's labels, which the
  operator copies into the pod's annotations once the pod is scheduled and the
  pod reads from a downward-API file (:mod:`orchestrator.operator.topology`);
* readiness: an exec probe (:mod:`orchestrator.operator.probe`) that is true
  while the node's registration exists in etcd, i.e. the agent is registered;
* preStop: the same module's ``drain``: SIGTERM to the agent (which treats it
  as a preemption: checkpoint, then leave) and wait until it has deregistered;
  ``terminationGracePeriodSeconds`` = ``fault_tolerance.preemption_grace`` plus
  a margin, so the save can finish before the kubelet's SIGKILL.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

from orchestrator.operator.api import (
    ANN_INDEX,
    ANN_TEMPLATE_HASH,
    DRAIN_COMMAND,
    GPU_RESOURCE,
    GRACE_MARGIN,
    PODINFO_DIR,
    READY_COMMAND,
    ROLE_AGENT,
    TOPOLOGY_FILE,
    OperatorSettings,
)
from orchestrator.operator.etcd_access import etcd_env, etcd_mounts, etcd_volumes
from orchestrator.operator.meta import agent_selector, child_meta, passed_labels, service_name
from orchestrator.operator.template import apply_template, gpu_toleration, template_metadata
from orchestrator.operator.trainingjob import PodTemplate
from orchestrator.spec.job import JobSpec

#: Non-root user of the image (k8s/Dockerfile creates it).
RUN_AS_USER = 1000


def pod_security() -> dict[str, Any]:
    """The ``securityContext`` of every pod the operator makes (agents and controller)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict[str, Any]:
    """The ``securityContext`` of the operator's own containers (agent, controller)."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


#: Runs the agent after exporting the topology labels (``$@`` is the agent's argv).
LAUNCH_SCRIPT = (
    'RINGMASTER_LABELS="$(python -m orchestrator.operator.topology)" || exit 1; '
    'export RINGMASTER_LABELS; exec "$@"'
)


def agent_command(spec: JobSpec, endpoints: tuple[str, ...]) -> list[str]:
    """The agent's command line; every option is one ``ringmaster agent`` accepts."""
    return ["ringmaster", "agent", "--job", spec.name, "--etcd", ",".join(endpoints)]


def container_command(spec: JobSpec, endpoints: tuple[str, ...]) -> list[str]:
    """The container's command: the launch script, then :func:`agent_command`."""
    return ["/bin/sh", "-c", LAUNCH_SCRIPT, "agent", *agent_command(spec, endpoints)]


def agent_env(
    spec: JobSpec, endpoints: tuple[str, ...], settings: OperatorSettings | None = None
) -> list[dict[str, Any]]:
    """Environment of the agent container (downward API + ringmaster settings).

    ``RINGMASTER_JOB`` and ``RINGMASTER_ETCD`` repeat the command line for the
    probes, which run as separate processes; etcd TLS, user and password come
    from :mod:`orchestrator.operator.etcd_access`.
    """

    def field(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = [
        field("NODE_NAME", "spec.nodeName"),
        field("POD_NAME", "metadata.name"),
        field("POD_NAMESPACE", "metadata.namespace"),
        field("POD_IP", "status.podIP"),
        {"name": "RINGMASTER_JOB", "value": spec.name},
        {"name": "RINGMASTER_ETCD", "value": ",".join(endpoints)},
        {"name": "RINGMASTER_NODE", "value": "$(POD_NAME)"},
        {"name": "RINGMASTER_ADDRESS", "value": "$(POD_IP)"},
        {"name": "RINGMASTER_TOPOLOGY_FILE", "value": TOPOLOGY_FILE},
        {
            "name": "RINGMASTER_DRAIN_TIMEOUT",
            "value": str(_ceil(spec.fault_tolerance.preemption_grace)),
        },
        {"name": "HOME", "value": "/tmp"},
    ]
    return env + etcd_env(spec, settings)


def agent_resources(spec: JobSpec) -> dict[str, Any]:
    """Requests equal limits (Guaranteed QoS: the last to be evicted under pressure)."""
    amounts: dict[str, Any] = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    if spec.resources.gpus:
        amounts[GPU_RESOURCE] = spec.resources.gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


def grace_seconds(spec: JobSpec) -> int:
    """``terminationGracePeriodSeconds``: the preemption grace plus a margin, rounded up."""
    return _ceil(spec.fault_tolerance.preemption_grace + GRACE_MARGIN)


def _ceil(duration: timedelta) -> int:
    seconds = duration.total_seconds()
    return int(seconds) + (0 if seconds == int(seconds) else 1)


def spread_constraints(spec: JobSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    """Spread the agent pods over machines, then racks, then zones (as the cluster allows).

    One agent per machine: a machine failure then costs one node of the job,
    which a spare replaces.  Across racks and zones: the pods the controller
    keeps as spares are then in different racks, so a rack that fails does not
    take the job's spares with it, and the controller can take a replacement
    from the failed node's own rack where one waits.  ``ScheduleAnyway``:
    these are preferences, never a reason to leave a pod pending.
    """
    selector = {"matchLabels": agent_selector(spec.name)}
    keys = ["kubernetes.io/hostname", *settings.rack_labels, *settings.zone_labels]
    return [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": selector,
        }
        for key in dict.fromkeys(keys)
    ]


def agent_pod_spec(
    spec: JobSpec,
    endpoints: tuple[str, ...],
    settings: OperatorSettings,
    template: PodTemplate | None = None,
) -> dict[str, Any]:
    """The pod ``spec`` shared by every agent pod of the job, with ``template`` merged in.

    Raises:
        SpecError: the template sets something the operator owns (see :mod:`.template`).
    """
    container: dict[str, Any] = {
        "name": "agent",
        "image": spec.resources.image,
        "imagePullPolicy": "IfNotPresent",
        "command": container_command(spec, endpoints),
        "env": agent_env(spec, endpoints, settings),
        "readinessProbe": {
            "exec": {"command": list(READY_COMMAND)},
            "initialDelaySeconds": 5,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 2,
        },
        "lifecycle": {"preStop": {"exec": {"command": list(DRAIN_COMMAND)}}},
        "resources": agent_resources(spec),
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *etcd_mounts(settings),
        ],
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "OnFailure",
        "subdomain": service_name(spec.name),
        "terminationGracePeriodSeconds": grace_seconds(spec),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(),
        "topologySpreadConstraints": spread_constraints(spec, settings),
        "containers": [container],
        "volumes": [
            {
                "name": "podinfo",
                "downwardAPI": {
                    "items": [
                        {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
                        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                    ]
                },
            },
            {"name": "tmp", "emptyDir": {}},
            # Shared memory for data loaders; it counts against the memory limit.
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            *etcd_volumes(settings),
        ],
    }
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    if spec.resources.gpus:
        pod_spec["tolerations"] = [gpu_toleration()]
    if template is not None:
        pod_spec = apply_template(pod_spec, template, spec.resources.image, f"job '{spec.name}'")
    return pod_spec


def template_hash(pod_spec: dict[str, Any], metadata: dict[str, Any] | None = None) -> str:
    """A short hash of the shared pod spec and template metadata; pods with another are out
    of date."""
    data = {"spec": pod_spec, "metadata": metadata} if metadata else pod_spec
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def pod_metadata_extras(
    body: dict[str, Any], template: PodTemplate | None
) -> tuple[dict[str, str], dict[str, str]]:
    """Labels and annotations an agent pod gets besides the operator's own.

    The TrainingJob's Kueue labels (:func:`.meta.passed_labels`) and the
    template's metadata (:func:`.template.template_metadata`).
    """
    labels = passed_labels(body)
    annotations: dict[str, str] = {}
    if template is not None:
        extra_labels, annotations = template_metadata(template, "TrainingJob")
        labels = {**extra_labels, **labels}
    return labels, annotations


def pod_name(job: str, index: int) -> str:
    return f"{job}-agent-{index}"


def agent_pod_hash(
    body: dict[str, Any],
    spec: JobSpec,
    endpoints: tuple[str, ...],
    settings: OperatorSettings,
    template: PodTemplate | None = None,
) -> str:
    """The template hash every up-to-date agent pod of the job carries."""
    labels, annotations = pod_metadata_extras(body, template)
    extras = {"labels": labels, "annotations": annotations} if labels or annotations else None
    return template_hash(agent_pod_spec(spec, endpoints, settings, template), extras)


def agent_pod(
    body: dict[str, Any],
    spec: JobSpec,
    index: int,
    endpoints: tuple[str, ...],
    settings: OperatorSettings,
    template: PodTemplate | None = None,
) -> dict[str, Any]:
    """Agent pod number ``index`` of the TrainingJob ``body``."""
    pod_spec = agent_pod_spec(spec, endpoints, settings, template)
    meta = child_meta(body, pod_name(spec.name, index), ROLE_AGENT)
    labels, annotations = pod_metadata_extras(body, template)
    meta["labels"] = {**labels, **meta["labels"]}
    meta["annotations"] = {
        **annotations,
        ANN_INDEX: str(index),
        ANN_TEMPLATE_HASH: agent_pod_hash(body, spec, endpoints, settings, template),
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
