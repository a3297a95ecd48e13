"""The fields a ``TrainingJob`` has beside the job spec: lifecycle and the pod template.

A TrainingJob's ``spec`` is a job spec (:class:`orchestrator.spec.job.JobSpec`, in
camelCase) plus the fields below, which only mean something on Kubernetes and
so are not part of the job file:

* ``suspend``: while true, no pods: the agent pods are deleted (each agent
  asks for a checkpoint and leaves once it is committed, as on a preemption),
  then the controller.  The job's records in etcd and its checkpoints stay, so
  setting it back to false resumes the job from that checkpoint.  It is set by
  hand (``kubectl patch``) or by any tool that flips it; Kueue does not (its
  integration for the TrainingJob kind is not built).
* ``ttlSecondsAfterFinished``: once the job has finished (Succeeded or
  Failed) for this long, the operator deletes the TrainingJob; its children
  go with it by garbage collection and its etcd records are removed.
* ``template``: a pod template (``metadata`` with labels and annotations,
  ``spec`` with a subset of a PodSpec) merged into every agent pod; see
  :mod:`orchestrator.operator.template` for how it is merged and what conflicts.

The dataclasses are the single description: :mod:`orchestrator.operator.crd_schema`
derives the CRD's schema from them (keys in camelCase, a description on every
field: its ``doc``, else the first line of its class's docstring; ``kubectl
explain`` shows these as written, so they are plain text, no reStructuredText)
and :func:`load_trainingjob_fields` reads a TrainingJob's ``spec`` with them
(:mod:`orchestrator.spec.dict_loader`), naming the field path of every problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.spec.dataclass_tree import fields_of
from orchestrator.spec.dict_loader import load_dataclass

#: Kubernetes quantities (the API's own pattern): ``500m``, ``2``, ``4Gi``, ``1e3``.
K8S_QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    """Field metadata: its description (shown by ``kubectl explain``) and schema extras."""
    return {"doc": text, **extra}


#: Schema of a free-form Kubernetes object kept as given (the API server checks it
#: when the pod is created; the operator reports a refusal in the TrainingJob's status).
FREE_FORM: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}

_QUANTITIES: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"x-kubernetes-int-or-string": True, "pattern": K8S_QUANTITY_PATTERN},
}


@dataclass
class EnvVar:
    """An environment variable: a literal value, or a valueFrom reference."""

    name: str = field(metadata=_doc("Variable name."))
    value: str | None = field(default=None, metadata=_doc("Literal value."))
    value_from: dict[str, Any] | None = field(
        default=None,
        metadata=_doc(
            "A Kubernetes EnvVarSource: secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef.",
            schema=FREE_FORM,
        ),
    )


@dataclass
class VolumeMount:
    """Where a volume of the template appears in the container."""

    name: str = field(metadata=_doc("Name of a volume in template.spec.volumes."))
    mount_path: str = field(metadata=_doc("Path in the container."))
    sub_path: str | None = field(default=None, metadata=_doc("Mount only this path of it."))
    read_only: bool = field(default=False, metadata=_doc("Mount read-only."))


@dataclass
class ResourceRequirements:
    """Requests and limits of any resource (amd.com/gpu, rdma/hca, hugepages...)."""

    requests: dict[str, str] = field(
        default_factory=dict,
        metadata=_doc("Resource name to quantity requested.", schema=_QUANTITIES, quantity=True),
    )
    limits: dict[str, str] = field(
        default_factory=dict,
        metadata=_doc(
            "Resource name to quantity allowed; extended resources need only a limit.",
            schema=_QUANTITIES,
            quantity=True,
        ),
    )


#: Linux capability names as Kubernetes takes them (capabilities(7), without ``CAP_``).
LINUX_CAPABILITIES = (
    "AUDIT_CONTROL",
    "AUDIT_READ",
    "AUDIT_WRITE",
    "BLOCK_SUSPEND",
    "BPF",
    "CHECKPOINT_RESTORE",
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "IPC_LOCK",
    "IPC_OWNER",
    "KILL",
    "LEASE",
    "LINUX_IMMUTABLE",
    "MAC_ADMIN",
    "MAC_OVERRIDE",
    "MKNOD",
    "NET_ADMIN",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_RAW",
    "PERFMON",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_CHROOT",
    "SYS_MODULE",
    "SYS_NICE",
    "SYS_PACCT",
    "SYS_PTRACE",
    "SYS_RAWIO",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "SYSLOG",
    "WAKE_ALARM",
    "ALL",
)


@dataclass
class Capabilities:
    """Linux capabilities added to or dropped from the container's."""

    add: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "Capabilities to add, e.g. IPC_LOCK for RDMA (effective only for a root user).",
            enum=LINUX_CAPABILITIES,
            no_default=True,
        ),
    )
    drop: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "Capabilities to drop (sidecars; the agent drops ALL).",
            enum=LINUX_CAPABILITIES,
            no_default=True,
        ),
    )


@dataclass
class SecurityContext:
    """A container's security settings; the agent's may add capabilities and set its user."""

    capabilities: Capabilities | None = field(
        default=None, metadata=_doc("Linux capabilities to add or drop.", no_default=True)
    )
    run_as_user: int | None = field(
        default=None, metadata=_doc("User id (0: root; needs runAsNonRoot false).", minimum=0)
    )
    run_as_group: int | None = field(default=None, metadata=_doc("Group id.", minimum=0))
    run_as_non_root: bool | None = field(
        default=None, metadata=_doc("Refuse to start as root (the pods' default: true).")
    )
    read_only_root_filesystem: bool | None = field(
        default=None, metadata=_doc("Sidecars only (the agent's root file system is read-only).")
    )
    allow_privilege_escalation: bool | None = field(
        default=None, metadata=_doc("Sidecars only (the agent's is false).")
    )
    privileged: bool | None = field(
        default=None, metadata=_doc("Sidecars only (the agent is never privileged).")
    )


@dataclass
class ContainerTemplate:
    """A container: 'agent' adds to ringmaster's agent container; any other is a sidecar."""

    name: str = field(metadata=_doc("'agent' for ringmaster's container, else a sidecar's name."))
    image: str | None = field(
        default=None, metadata=_doc("Image of a sidecar (the agent's is resources.image).")
    )
    command: list[str] = field(
        default_factory=list, metadata=_doc("Command of a sidecar (the agent's is ringmaster's).")
    )
    args: list[str] = field(default_factory=list, metadata=_doc("Arguments of a sidecar."))
    env: list[EnvVar] = field(
        default_factory=list,
        metadata=_doc("Environment variables; the RINGMASTER_* ones the operator sets win."),
    )
    env_from: list[dict[str, Any]] = field(
        default_factory=list,
        metadata=_doc(
            "Kubernetes EnvFromSources (all keys of a ConfigMap or Secret).",
            schema={"type": "array", "items": FREE_FORM},
        ),
    )
    volume_mounts: list[VolumeMount] = field(
        default_factory=list, metadata=_doc("Volumes of the template mounted in this container.")
    )
    resources: ResourceRequirements = field(
        default_factory=ResourceRequirements,
        metadata=_doc(
            "Resources beyond resources.cpu/memory/gpus: other devices (amd.com/gpu, RDMA), "
            "hugepages, ephemeral-storage."
        ),
    )
    security_context: SecurityContext | None = field(
        default=None,
        metadata=_doc(
            "A sidecar's security settings; for the agent only capabilities.add and the user.",
            no_default=True,
        ),
    )


@dataclass
class Toleration:
    """A Kubernetes toleration (lets pods run on nodes with a matching taint)."""

    key: str | None = field(default=None, metadata=_doc("Taint key; empty matches every key."))
    operator: str | None = field(
        default=None, metadata=_doc("Equal (default) or Exists.", enum=["Equal", "Exists"])
    )
    value: str | None = field(default=None, metadata=_doc("Taint value (with Equal)."))
    effect: str | None = field(
        default=None,
        metadata=_doc(
            "NoSchedule, PreferNoSchedule or NoExecute; empty matches all.",
            enum=["NoSchedule", "PreferNoSchedule", "NoExecute"],
        ),
    )
    toleration_seconds: int | None = field(
        default=None, metadata=_doc("With NoExecute: how long the pod stays after the taint.")
    )


@dataclass
class ObjectReference:
    """A reference to an object in the job's namespace, by name."""

    name: str = field(metadata=_doc("Object name."))


@dataclass
class PodSpecTemplate:
    """The parts of a PodSpec a TrainingJob may set for its agent pods."""

    volumes: list[dict[str, Any]] = field(
        default_factory=list,
        metadata=_doc(
            "Kubernetes Volumes (persistentVolumeClaim, emptyDir with medium Memory for "
            "/dev/shm, configMap, secret, csi...); mount them with containers[].volumeMounts.",
            schema={
                "type": "array",
                "items": {
                    **FREE_FORM,
                    "required": ["name"],
                    "properties": {"name": {"type": "string", "description": "Volume name."}},
                },
            },
        ),
    )
    containers: list[ContainerTemplate] = field(
        default_factory=list,
        metadata=_doc("'agent' adds env, mounts and resources to ringmaster's container."),
    )
    node_selector: dict[str, str] = field(
        default_factory=dict, metadata=_doc("Node labels the pods must run on.")
    )
    affinity: dict[str, Any] | None = field(
        default=None,
        metadata=_doc("Kubernetes Affinity (node, pod and pod anti-affinity).", schema=FREE_FORM),
    )
    tolerations: list[Toleration] = field(
        default_factory=list, metadata=_doc("Tolerations, added to the GPU toleration.")
    )
    image_pull_secrets: list[ObjectReference] = field(
        default_factory=list,
        metadata=_doc("Secrets for a private registry (agent and controller pods)."),
    )
    priority_class_name: str | None = field(
        default=None, metadata=_doc("PriorityClass of the agent pods.")
    )
    service_account_name: str | None = field(
        default=None,
        metadata=_doc(
            "ServiceAccount of the agent pods (e.g. one bound to a cloud role for the "
            "checkpoint store); wins over the operator's RINGMASTER_JOB_SERVICE_ACCOUNT."
        ),
    )
    automount_service_account_token: bool | None = field(
        default=None,
        metadata=_doc("Mount the ServiceAccount's API token (default: false)."),
    )
    scheduler_name: str | None = field(
        default=None, metadata=_doc("Scheduler of the agent pods (default: the cluster's).")
    )
    runtime_class_name: str | None = field(
        default=None, metadata=_doc("RuntimeClass of the agent pods (e.g. nvidia).")
    )


@dataclass
class TemplateMetadata:
    """Labels and annotations added to every agent pod."""

    labels: dict[str, str] = field(
        default_factory=dict, metadata=_doc("Labels; ringmaster's own keys cannot be set.")
    )
    annotations: dict[str, str] = field(
        default_factory=dict, metadata=_doc("Annotations; ringmaster.dev/ keys cannot be set.")
    )


@dataclass
class PodTemplate:
    """A pod template merged into every agent pod (the way Kubeflow and JobSet take one)."""

    metadata: TemplateMetadata = field(
        default_factory=TemplateMetadata, metadata=_doc("Labels and annotations of the pods.")
    )
    spec: PodSpecTemplate = field(
        default_factory=PodSpecTemplate,
        metadata=_doc("Volumes, node selection, tolerations, secrets, devices of the pods."),
    )


@dataclass
class TrainingJobFields:
    """The fields of a TrainingJob's spec that a job file does not have."""

    suspend: bool = field(
        default=False,
        metadata=_doc(
            "True: the agent pods save a checkpoint and are removed, then the controller; "
            "the job's state stays and it goes on from that checkpoint when set back to "
            "false. Set by hand or any tool (no Kueue integration is built)."
        ),
    )
    ttl_seconds_after_finished: int | None = field(
        default=None,
        metadata=_doc(
            "Delete the TrainingJob this many seconds after it Succeeded or Failed "
            "(unset: keep it).",
            minimum=0,
        ),
    )
    template: PodTemplate = field(
        default_factory=PodTemplate,
        metadata=_doc("Pod template merged into every agent pod."),
    )


#: The TrainingJob-only keys of ``spec`` (camelCase), taken out before the job spec loader.
FIELD_KEYS = tuple(f.camel for f in fields_of(TrainingJobFields))


def split_spec(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A TrainingJob's ``spec`` → (the job spec part, the TrainingJob-only part)."""
    job = {k: v for k, v in data.items() if k not in FIELD_KEYS}
    extra = {k: v for k, v in data.items() if k in FIELD_KEYS}
    return job, extra


def load_trainingjob_fields(
    data: dict[str, Any], source: str = "<TrainingJob>"
) -> TrainingJobFields:
    """Read the TrainingJob-only part of a spec (see :func:`split_spec`).

    Raises:
        SpecError: every problem, each with its field path (``template.spec.tolerations[0]``).
    """
    return load_dataclass(TrainingJobFields, data, source)
