"""Merging a TrainingJob's pod template into the agent pod the operator renders.

The operator renders the agent pod (:mod:`.pods`) and then adds the
template's parts to it.  What the operator must own wins, and a template
that tries to set it is a :class:`~orchestrator.api.SpecError` naming the
template field, which the handlers show as phase ``Invalid`` in the
TrainingJob's status: nothing is silently dropped.

* ``metadata.labels`` / ``annotations``: added to the pod; keys under
  ``ringmaster.dev/`` and the ``app.kubernetes.io/`` labels the operator sets
  conflict.
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
* other containers are sidecars, added as given (they need an image).
* ``nodeSelector``, ``affinity``, ``priorityClassName``, ``schedulerName``,
  ``runtimeClassName``, ``imagePullSecrets``, ``serviceAccountName`` and
  ``automountServiceAccountToken`` are set on the pod (the job's service
  account wins over the operator's default); ``tolerations`` are added to the
  GPU toleration.  ``imagePullSecrets`` go to the controller pod too: it runs
  the same image.
"""

from __future__ import annotations

import copy
from typing import Any

from orchestrator.api import SpecError, SpecProblem
from orchestrator.operator.api import (
    GPU_RESOURCE,
    GROUP,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
)
from orchestrator.operator.trainingjob import (
    ContainerTemplate,
    EnvVar,
    PodTemplate,
    VolumeMount,
)

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
    return out


def _toleration(tol: Any) -> dict[str, Any]:
    return {
        "key": tol.key,
        "operator": tol.operator,
        "value": tol.value,
        "effect": tol.effect,
        "tolerationSeconds": tol.toleration_seconds,
    }
