"""Contracts of the Kubernetes operator: names, settings, plans and errors.

The operator turns a ``TrainingJob`` custom resource into child objects
(a headless Service, agent pods, a controller Deployment, a
PodDisruptionBudget) and copies the controller's status from etcd into the
resource's status.  Everything here is plain data: the reconcile logic works
on dicts shaped like Kubernetes objects, so it runs without a cluster, and
only :mod:`orchestrator.operator.kube` talks to the API server.

Errors come in two kinds, as kopf expects them: :class:`RetryableOperatorError`
(the API server or etcd is briefly unavailable, a write conflicted; the
handler runs again later) and :class:`PermanentOperatorError` (the spec is
invalid, the API refused the object; retrying changes nothing until the user
edits the resource).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from orchestrator.api import OrchestratorError
from orchestrator.settings import SETTINGS

# --------------------------------------------------------------------------- names

#: API group, version and names of the custom resource.
GROUP = "ringmaster.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj", "tjob")

#: Labels every child carries; ``LABEL_JOB`` + ``LABEL_ROLE`` select agent pods.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB = f"{GROUP}/job"
LABEL_ROLE = f"{GROUP}/role"
ROLE_AGENT = "agent"
ROLE_CONTROLLER = "controller"
MANAGED_BY = "ringmaster-operator"

#: Pod annotations written by the operator.
ANN_INDEX = f"{GROUP}/index"
ANN_TEMPLATE_HASH = f"{GROUP}/template-hash"
ANN_ZONE = f"{GROUP}/zone"
ANN_RACK = f"{GROUP}/rack"
ANN_HOST = f"{GROUP}/host"
#: Set to "true" once the node lookup is done, even when the node has no zone/rack labels.
ANN_TOPOLOGY_READY = f"{GROUP}/topology-ready"

#: Exec probes of the agent container (see :mod:`orchestrator.operator.probe`).
READY_COMMAND = ("python", "-m", "orchestrator.operator.probe", "ready")
DRAIN_COMMAND = ("python", "-m", "orchestrator.operator.probe", "drain")

#: Downward-API volume with the pod's labels and annotations (topology lives there).
PODINFO_DIR = "/etc/ringmaster/podinfo"
TOPOLOGY_FILE = f"{PODINFO_DIR}/annotations"

#: Extra seconds beyond ``fault_tolerance.preemption_grace`` before the kubelet kills.
GRACE_MARGIN = timedelta(seconds=15)

#: How often the operator re-reads the controller's status and re-checks children.
SYNC_INTERVAL = SETTINGS.operator_sync

#: The GPU extended resource requested for ``resources.gpus``.
GPU_RESOURCE = "nvidia.com/gpu"

#: Port (and its name) of a job controller's Prometheus endpoint and of its metrics Service.
METRICS_PORT = 9400
METRICS_PORT_NAME = "metrics"

#: Pod labels with the node's topology, written by the operator once the pod is scheduled.
LABEL_ZONE = f"{GROUP}/zone"
LABEL_RACK = f"{GROUP}/rack"
LABEL_HOST = f"{GROUP}/host"
#: The node label that names the machine (its value is a valid label value, the name may not be).
HOSTNAME_LABEL = "kubernetes.io/hostname"

# --------------------------------------------------------------------------- errors


class OperatorError(OrchestratorError):
    """Base of every error raised by the operator."""


class RetryableOperatorError(OperatorError):
    """Worth trying again: API or etcd unavailable, conflict, throttling."""

    def __init__(self, message: str, delay: timedelta = timedelta(seconds=10)) -> None:
        super().__init__(message)
        self.delay = delay


class PermanentOperatorError(OperatorError):
    """Retrying will not help until the TrainingJob (or the cluster setup) is changed."""


class RejectedObjectError(PermanentOperatorError):
    """The API server found an object the operator rendered invalid (400, 422).

    A pod template's free-form parts (volumes, affinity, ``valueFrom``) are
    checked by the API server only when the pod is created; the handlers show
    this in the TrainingJob's status.
    """


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class OperatorSettings:
    """How the operator is set up (environment of its Deployment).

    Attributes:
        etcd_endpoints: etcd used by jobs that give no ``rendezvous.endpoints``.
        rack_labels: Node labels that name a node's rack, first found wins.
        zone_labels: Node labels that name a node's zone, first found wins.
        service_account: ServiceAccount of agent and controller pods ("" = namespace default).
        controller_cpu / controller_memory: requests of the controller pod.
        etcd_ca / etcd_cert / etcd_key / etcd_user / etcd_password: how the operator
            itself reaches etcd (files in its own pod; the password is never shown).
        etcd_tls_secret: a Secret with ``ca.crt``, ``tls.crt`` and ``tls.key``
            mounted read-only into every agent and controller pod for etcd TLS.
        etcd_password_secret / etcd_password_key: a Secret (and its key) whose value
            reaches agent and controller pods as ``RINGMASTER_ETCD_PASSWORD``.
    """

    etcd_endpoints: tuple[str, ...] = ()
    rack_labels: tuple[str, ...] = ("topology.ringmaster.dev/rack", "topology.kubernetes.io/rack")
    zone_labels: tuple[str, ...] = ("topology.kubernetes.io/zone",)
    service_account: str = ""
    controller_cpu: str = "250m"
    controller_memory: str = "512Mi"
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = field(default=None, repr=False)
    etcd_tls_secret: str = ""
    etcd_password_secret: str = ""
    etcd_password_key: str = "password"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        """Read ``RINGMASTER_ETCD`` (and ``_CA``, ``_CERT``, ``_KEY``, ``_USER``,
        ``_PASSWORD``, ``_TLS_SECRET``, ``_PASSWORD_SECRET``, ``_PASSWORD_SECRET_KEY``),
        ``RINGMASTER_RACK_LABELS``, ``RINGMASTER_ZONE_LABELS``,
        ``RINGMASTER_JOB_SERVICE_ACCOUNT``."""
        env = dict(os.environ if env is None else env)
        default = cls()

        def split(name: str, fallback: tuple[str, ...]) -> tuple[str, ...]:
            raw = env.get(name)
            if raw is None:
                return fallback
            return tuple(s.strip() for s in raw.split(",") if s.strip())

        return cls(
            etcd_endpoints=split("RINGMASTER_ETCD", ()),
            rack_labels=split("RINGMASTER_RACK_LABELS", default.rack_labels),
            zone_labels=split("RINGMASTER_ZONE_LABELS", default.zone_labels),
            service_account=env.get("RINGMASTER_JOB_SERVICE_ACCOUNT", ""),
            etcd_ca=env.get("RINGMASTER_ETCD_CA") or None,
            etcd_cert=env.get("RINGMASTER_ETCD_CERT") or None,
            etcd_key=env.get("RINGMASTER_ETCD_KEY") or None,
            etcd_user=env.get("RINGMASTER_ETCD_USER") or None,
            etcd_password=env.get("RINGMASTER_ETCD_PASSWORD") or None,
            etcd_tls_secret=env.get("RINGMASTER_ETCD_TLS_SECRET", ""),
            etcd_password_secret=env.get("RINGMASTER_ETCD_PASSWORD_SECRET", ""),
            etcd_password_key=env.get("RINGMASTER_ETCD_PASSWORD_SECRET_KEY", "password"),
        )


# --------------------------------------------------------------------------- plans


@dataclass
class Observed:
    """The children of one TrainingJob as the API server reports them (plain dicts)."""

    pods: list[dict[str, Any]] = field(default_factory=list)
    service: dict[str, Any] | None = None
    controller: dict[str, Any] | None = None
    pdb: dict[str, Any] | None = None
    metrics_service: dict[str, Any] | None = None


@dataclass(frozen=True)
class JobEvent:
    """A Kubernetes Event to post on the TrainingJob (``kubectl describe`` shows it).

    Attributes:
        type: ``Normal`` or ``Warning``.
        reason: one CamelCase word (``NodeFailed``, ``Recovered``, ``Checkpoint``...).
        message: what happened, for a person.
    """

    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class Deletion:
    """One child to delete and why (the reason becomes a Kubernetes event)."""

    kind: str
    name: str
    reason: str


@dataclass
class ReconcilePlan:
    """What to change so the children match the TrainingJob.

    Attributes:
        create: objects to create.
        apply: existing objects whose desired form differs; replaced as a whole.
        delete: children to delete (a ``TrainingJob`` deletion is the job itself:
            its ``ttlSecondsAfterFinished`` passed).
        status: the full ``status`` to write on the TrainingJob.
        events: Kubernetes Events to post on the TrainingJob.
    """

    create: list[dict[str, Any]] = field(default_factory=list)
    apply: list[dict[str, Any]] = field(default_factory=list)
    delete: list[Deletion] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[JobEvent] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.create or self.apply or self.delete)


# --------------------------------------------------------------------------- ports


class KubeApi(Protocol):
    """What the operator needs from the Kubernetes API (see :mod:`.kube`)."""

    def list_children(self, namespace: str, job: str) -> Observed: ...

    def create(self, obj: dict[str, Any]) -> None: ...

    def replace(self, obj: dict[str, Any]) -> None: ...

    def delete(self, namespace: str, kind: str, name: str) -> None: ...

    def node_labels(self, node: str) -> dict[str, str]: ...

    def annotate_pod(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str],
        labels: dict[str, str] | None = None,
    ) -> None: ...

    def get_training_job(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...

    def post_event(self, job: dict[str, Any], event: JobEvent) -> None:
        """Post ``event`` about the TrainingJob ``job``; never raises (events are advisory)."""
        ...


class JobRecords(Protocol):
    """The job's records in etcd, as far as the operator touches them (see :mod:`.records`)."""

    def ensure_spec(self, endpoints: tuple[str, ...], spec: Any) -> bool:
        """Make etcd hold ``spec``; True when something was written."""
        ...

    def read_status(self, endpoints: tuple[str, ...], job: str) -> dict[str, Any] | None: ...

    def forget(self, endpoints: tuple[str, ...], job: str) -> None: ...
