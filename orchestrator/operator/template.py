"""Merging a TrainingJob's pod template into the agent pod the operator renders.

The operator renders the agent pod (:mod:`.pods`) and then adds the
template's parts to it.  What the operator must own wins, and a template
that tries to set it is a :class:`~orchestrator.spec.api.SpecError` naming the
template field, which the handlers show as phase ``Invalid`` in the
TrainingJob's status: nothing is silently dropped.

* ``metadata.labels`` / ``annotations``: added to the pod; keys under
  ``ringmaster.dev/`` and the ``app.kubernetes.io/`` labels the operator sets
  conflict, and so do ``kueue.x-k8s.io/queue-name`` and ``/priority-class``:
  the operator copies those from the TrainingJob's own labels
  (:func:`.meta.passed_labels`), and two places for one label would let one
  silently win.
* ``spec.volumes``: added; a name the operator uses (``podinfo``, ``tmp``,
  ``dshm``, ``etcd-tls``) conflicts.  A template volume mounted at
  ``/dev/shm`` or ``/tmp`` in the agent container *replaces* the operator's
  default there (an in-memory ``/dev/shm`` with a ``sizeLimit``, a bigger
  scratch disk); the downward-API and etcd TLS mounts cannot be replaced.
* ``spec.containers`` named ``agent``: its ``env``, ``envFrom``,
  ``volumeMounts`` and ``resources`` are added to ringmaster's container.
  Its command, args and image are ringmaster's (an image other than
  ``resources.image`` conflicts); an env variable the operator sets
  (``RINGMASTER_*``, ``NODE_NAME``...) conflicts; ``cpu`` and ``memory`` come
  from ``resources.cpu`` / ``resources.memory`` and ``nvidia.com/gpu`` from
  ``resources.gpus``, any other resource (``amd.com/gpu``, RDMA devices,
  hugepages) from the template.
* its ``securityContext`` may add capabilities (``IPC_LOCK`` for RDMA; not
  ``ALL``) and set ``runAsUser`` / ``runAsGroup`` / ``runAsNonRoot``; the
  rest is the operator's (all other capabilities dropped, no privilege
  escalation, a read-only root file system, never privileged), and
  ``runAsUser: 0`` needs ``runAsNonRoot: false``.  See :func:`agent_security`
  for why an added capability needs root.
* other containers are sidecars, added as given (they need an image); a
  sidecar's own ``securityContext`` overrides the pod's (which runs every
  container as user 1000, non-root).
* ``nodeSelector``, ``affinity``, ``priorityClassName``, ``schedulerName``,
  ``runtimeClassName``, ``imagePullSecrets``, ``serviceAccountName`` and
  ``automountServiceAccountToken`` are set on the pod (the job's service
  account wins over the operator's default); ``tolerations`` are added to the
  GPU toleration.  The scheduling ones (``nodeSelector``, node affinity,
  ``tolerations``, ``imagePullSecrets``, ``priorityClassName``) go to the
  controller pod too (:func:`controller_scheduling`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from orchestrator.operator.api import (
    GPU_RESOURCE,
    GROUP,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
)
from orchestrator.operator.meta import PASSED_LABELS
from orchestrator.operator.trainingjob import (
    ContainerTemplate,
    EnvVar,
    PodTemplate,
    SecurityContext,
    VolumeMount,
)
from orchestrator.spec.api import SpecError, SpecProblem
from orchestrator.spec.dataclass_tree import camel_key

AGENT_CONTAINER = "agent"
#: Mount paths whose operator default a template volume may replace, and the default's volume.
REPLACEABLE_MOUNTS = {"/dev/shm": "dshm", "/tmp": "tmp"}
#: Labels the operator sets on every child besides its own ``ringmaster.dev/`` keys.
OWNED_LABELS = (LABEL_NAME, LABEL_INSTANCE, LABEL_COMPONENT, LABEL_MANAGED_BY)
#: Resources that have a field of their own in ``resources``.
OWNED_RESOURCES = {
    "cpu": "resources.cpu",
    "memory": "resources.memory",
    GPU_RESOURCE: "resources.gpus",
}

_T = "template"


def env_var(var: EnvVar) -> dict[str, Any]:
    out: dict[str, Any] = {"name": var.name}
    if var.value is not None:
        out["value"] = var.value
    if var.value_from is not None:
        out["valueFrom"] = copy.deepcopy(var.value_from)
    return out


def volume_mount(mount: VolumeMount) -> dict[str, Any]:
    out: dict[str, Any] = {"name": mount.name, "mountPath": mount.mount_path}
    if mount.sub_path:
        out["subPath"] = mount.sub_path
    if mount.read_only:
        out["readOnly"] = True
    return out


def resource_requirements(c: ContainerTemplate) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if c.resources.requests:
        out["requests"] = dict(c.resources.requests)
    if c.resources.limits:
        out["limits"] = dict(c.resources.limits)
    return out


def template_metadata(template: PodTemplate, source: str) -> tuple[dict[str, str], dict[str, str]]:
    """The template's labels and annotations for the pod.

    Raises:
        SpecError: a key the operator owns is set.
    """
    problems: list[SpecProblem] = []
    owned = f"{GROUP}/"
    for key in template.metadata.labels:
        if key.startswith(owned) or key in OWNED_LABELS:
            problems.append(
                SpecProblem(
                    f"{_T}.metadata.labels.{key}",
                    f"'{key}' is a label the operator sets on every pod of the job; "
                    "use a key of your own",
                    None,
                    source,
                )
            )
        elif key in PASSED_LABELS:
            problems.append(
                SpecProblem(
                    f"{_T}.metadata.labels.{key}",
                    f"'{key}' is copied to the pods from the TrainingJob's own "
                    "metadata.labels; set it there, not in the template",
                    None,
                    source,
                )
            )
    for key in template.metadata.annotations:
        if key.startswith(owned):
            problems.append(
                SpecProblem(
                    f"{_T}.metadata.annotations.{key}",
                    f"keys under '{owned}' are the operator's (pod index, topology); "
                    "use a key of your own",
                    None,
                    source,
                )
            )
    if problems:
        raise SpecError(problems)
    return dict(template.metadata.labels), dict(template.metadata.annotations)


def apply_template(
    pod_spec: dict[str, Any], template: PodTemplate, image: str, source: str = "<TrainingJob>"
) -> dict[str, Any]:
    """``pod_spec`` (the operator's agent pod spec) with ``template`` merged in.

    Args:
        pod_spec: the rendered agent pod spec; not changed.
        template: the TrainingJob's ``spec.template``.
        image: ``resources.image`` (the agent container's image).
        source: names the TrainingJob in problems.

    Raises:
        SpecError: every conflict, each naming the template field and what to do.
    """
    out = copy.deepcopy(pod_spec)
    t = template.spec
    problems: list[SpecProblem] = []

    def conflict(path: str, message: str) -> None:
        problems.append(SpecProblem(f"{_T}.spec.{path}", message, None, source))

    agent = next(c for c in out["containers"] if c["name"] == AGENT_CONTAINER)
    mine = [(i, c) for i, c in enumerate(t.containers) if c.name == AGENT_CONTAINER]
    mounts_wanted = [(i, j, m) for i, c in mine for j, m in enumerate(c.volume_mounts)]

    # /dev/shm and /tmp: a template mount there replaces the operator's default.
    replaced = {m.mount_path for _, _, m in mounts_wanted if m.mount_path in REPLACEABLE_MOUNTS}
    for path in replaced:
        name = REPLACEABLE_MOUNTS[path]
        agent["volumeMounts"] = [v for v in agent["volumeMounts"] if v["mountPath"] != path]
        out["volumes"] = [v for v in out["volumes"] if v["name"] != name]

    owned_volumes = {v["name"] for v in out["volumes"]}
    template_volumes: set[str] = set()
    for i, volume in enumerate(t.volumes):
        name = volume["name"]
        if name in owned_volumes:
            conflict(
                f"volumes[{i}].name",
                f"'{name}' is a volume of the operator's; give yours another name",
            )
        elif name in template_volumes:
            conflict(f"volumes[{i}].name", f"'{name}' is given twice")
        template_volumes.add(name)
        out["volumes"].append(copy.deepcopy(volume))

    if len(mine) > 1:
        conflict(f"containers[{mine[1][0]}].name", "only one container may be named 'agent'")
    owned_env = {e["name"] for e in agent["env"]}
    owned_paths = {m["mountPath"] for m in agent["volumeMounts"]}
    for i, c in mine:
        at = f"containers[{i}]"
        if c.image is not None and c.image != image:
            conflict(
                f"{at}.image",
                f"the agent's image is resources.image ('{image}'); set it there and "
                "leave it out here",
            )
        if c.command or c.args:
            conflict(
                f"{at}.command" if c.command else f"{at}.args",
                "the agent's command is ringmaster's (`ringmaster agent ...`); what the "
                "workers run is spec.entrypoint (script or module, args, env)",
            )
        for j, var in enumerate(c.env):
            if var.name in owned_env:
                conflict(
                    f"{at}.env[{j}].name",
                    f"{var.name} is set by the operator; use another name (worker "
                    "variables go in entrypoint.env)",
                )
            agent["env"].append(env_var(var))
        agent.setdefault("envFrom", []).extend(copy.deepcopy(e) for e in c.env_from)
        if not agent["envFrom"]:
            del agent["envFrom"]
        for j, m in enumerate(c.volume_mounts):
            if m.mount_path in owned_paths:
                conflict(
                    f"{at}.volumeMounts[{j}].mountPath",
                    f"{m.mount_path} is where the operator mounts its own files; mount yours "
                    "elsewhere",
                )
            if m.name not in template_volumes:
                conflict(
                    f"{at}.volumeMounts[{j}].name",
                    f"no volume named '{m.name}' in template.spec.volumes; add it there",
                )
            agent["volumeMounts"].append(volume_mount(m))
        if c.security_context is not None:
            agent_security(agent, c.security_context, f"{at}.securityContext", conflict)
        for kind in ("requests", "limits"):
            for name, amount in getattr(c.resources, kind).items():
                if name in OWNED_RESOURCES:
                    conflict(
                        f"{at}.resources.{kind}.{name}",
                        f"{name} of the agent comes from {OWNED_RESOURCES[name]}; set it "
                        "there and leave it out here",
                    )
                    continue
                agent["resources"].setdefault(kind, {})[name] = amount

    names = {AGENT_CONTAINER}
    for i, c in enumerate(t.containers):
        if c.name == AGENT_CONTAINER:
            continue
        if c.name in names:
            conflict(f"containers[{i}].name", f"'{c.name}' is given twice")
        names.add(c.name)
        if not c.image:
            conflict(f"containers[{i}].image", f"sidecar '{c.name}' needs an image")
        for j, m in enumerate(c.volume_mounts):
            if m.name not in template_volumes:
                conflict(
                    f"containers[{i}].volumeMounts[{j}].name",
                    f"no volume named '{m.name}' in template.spec.volumes; add it there",
                )
        out["containers"].append(sidecar(c))

    if t.node_selector:
        out["nodeSelector"] = dict(t.node_selector)
    if t.affinity is not None:
        out["affinity"] = copy.deepcopy(t.affinity)
    if t.tolerations:
        out.setdefault("tolerations", []).extend(
            {k: v for k, v in tol.items() if v is not None}
            for tol in map(_toleration, t.tolerations)
        )
    if t.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": s.name} for s in t.image_pull_secrets]
    for key, value in (
        ("priorityClassName", t.priority_class_name),
        ("serviceAccountName", t.service_account_name),
        ("automountServiceAccountToken", t.automount_service_account_token),
        ("schedulerName", t.scheduler_name),
        ("runtimeClassName", t.runtime_class_name),
    ):
        if value is not None:
            out[key] = value
    if problems:
        raise SpecError(problems)
    return out


def gpu_toleration() -> dict[str, Any]:
    """Tolerates the taint GPU node pools commonly carry (``nvidia.com/gpu``, NoSchedule)."""
    return {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def controller_scheduling(template: PodTemplate, gpus: bool) -> dict[str, Any]:
    """Where the job's controller pod may run: the template's scheduling fields.

    The controller runs the agents' image and must schedule on a cluster whose
    nodes are all tainted GPU nodes: it gets the template's ``nodeSelector``,
    its ``affinity.nodeAffinity``, its ``tolerations`` (and the GPU toleration
    when the job has GPUs), ``imagePullSecrets`` and ``priorityClassName`` (a
    controller below its agents' priority could be preempted for them).  Not
    ``podAffinity`` / ``podAntiAffinity`` (written for agent pods: a rule
    keeping agents apart could leave no node for the controller),
    ``schedulerName``, ``runtimeClassName``, volumes, containers or the
    service account: the controller needs no device, data or cloud role.
    """
    t = template.spec
    out: dict[str, Any] = {}
    if t.node_selector:
        out["nodeSelector"] = dict(t.node_selector)
    node_affinity = (t.affinity or {}).get("nodeAffinity")
    if node_affinity:
        out["affinity"] = {"nodeAffinity": copy.deepcopy(node_affinity)}
    tolerations = [gpu_toleration()] if gpus else []
    tolerations += [
        {k: v for k, v in tol.items() if v is not None} for tol in map(_toleration, t.tolerations)
    ]
    if tolerations:
        out["tolerations"] = tolerations
    if t.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": s.name} for s in t.image_pull_secrets]
    if t.priority_class_name is not None:
        out["priorityClassName"] = t.priority_class_name
    return out


#: Security settings of the agent container that are the operator's (template field: value).
OWNED_SECURITY = {
    "read_only_root_filesystem": ("readOnlyRootFilesystem", "true"),
    "allow_privilege_escalation": ("allowPrivilegeEscalation", "false"),
    "privileged": ("privileged", "false"),
}


def agent_security(
    agent: dict[str, Any],
    wanted: SecurityContext,
    at: str,
    conflict: Callable[[str, str], None],
) -> None:
    """Add the template's ``securityContext`` of the agent container to ``agent``.

    The agent may add capabilities (``IPC_LOCK`` for RDMA memory registration)
    and choose its user; dropping capabilities, privilege escalation, a
    writable root file system and privileged mode are the operator's.  A
    capability added for a non-root user is in the container's bounding set
    only (Kubernetes sets no ambient capabilities), so it takes effect only
    with ``runAsUser: 0``, which needs ``runAsNonRoot: false`` beside it (the
    pod runs as non-root by default).
    """
    ctx = agent["securityContext"]
    caps = wanted.capabilities
    if caps is not None:
        if caps.drop:
            conflict(
                f"{at}.capabilities.drop",
                "the agent drops ALL capabilities already; only capabilities.add may be set",
            )
        if "ALL" in caps.add:
            i = caps.add.index("ALL")
            conflict(
                f"{at}.capabilities.add[{i}]",
                "name the capabilities the agent needs (IPC_LOCK for RDMA), not ALL",
            )
        elif caps.add:
            ctx["capabilities"]["add"] = list(dict.fromkeys(caps.add))
    for name, (key, value) in OWNED_SECURITY.items():
        if getattr(wanted, name) is not None:
            conflict(f"{at}.{camel_key(name)}", f"the agent's {key} is the operator's ({value})")
    if wanted.run_as_user == 0 and wanted.run_as_non_root is not False:
        conflict(
            f"{at}.runAsUser",
            "runAsUser 0 (root) needs runAsNonRoot: false here too: the pods run as non-root "
            "by default",
        )
    for name in ("run_as_user", "run_as_group", "run_as_non_root"):
        value = getattr(wanted, name)
        if value is not None:
            ctx[camel_key(name)] = value


def security_context(wanted: SecurityContext) -> dict[str, Any]:
    """A sidecar's ``securityContext`` as given (set fields only)."""
    out: dict[str, Any] = {}
    if wanted.capabilities is not None:
        caps = {k: list(v) for k, v in dataclasses.asdict(wanted.capabilities).items() if v}
        if caps:
            out["capabilities"] = caps
    for f in dataclasses.fields(wanted):
        value = getattr(wanted, f.name)
        if f.name != "capabilities" and value is not None:
            out[camel_key(f.name)] = value
    return out


def sidecar(c: ContainerTemplate) -> dict[str, Any]:
    out: dict[str, Any] = {"name": c.name, "image": c.image}
    if c.command:
        out["command"] = list(c.command)
    if c.args:
        out["args"] = list(c.args)
    if c.env:
        out["env"] = [env_var(v) for v in c.env]
    if c.env_from:
        out["envFrom"] = copy.deepcopy(c.env_from)
    if c.volume_mounts:
        out["volumeMounts"] = [volume_mount(m) for m in c.volume_mounts]
    resources = resource_requirements(c)
    if resources:
        out["resources"] = resources
    if c.security_context is not None:
        out["securityContext"] = security_context(c.security_context)
    return out


def _toleration(tol: Any) -> dict[str, Any]:
    return {
        "key": tol.key,
        "operator": tol.operator,
        "value": tol.value,
        "effect": tol.effect,
        "tolerationSeconds": tol.toleration_seconds,
    }
