"""Names, labels and owner references shared by every child of a TrainingJob.

Every child carries an owner reference to its TrainingJob (``controller:
true``, ``blockOwnerDeletion: true``), so deleting the TrainingJob lets the
Kubernetes garbage collector delete the pods, Service, Deployment and
PodDisruptionBudget; the operator never has to find orphans.
"""

from __future__ import annotations

from typing import Any

from orchestrator.operator.api import (
    API_VERSION,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_ROLE,
    MANAGED_BY,
    ROLE_AGENT,
)


def service_name(job: str) -> str:
    """The headless Service; pods get DNS names ``<pod>.<service>.<namespace>.svc``."""
    return f"{job}-agents"


def controller_name(job: str) -> str:
    return f"{job}-controller"


def metrics_service_name(job: str) -> str:
    """The Service in front of the controller's metrics endpoint."""
    return f"{job}-metrics"


def pdb_name(job: str) -> str:
    return f"{job}-agents"


def labels(job: str, role: str) -> dict[str, str]:
    """The labels of a child with ``role`` (agent or controller)."""
    return {
        LABEL_NAME: "ringmaster",
        LABEL_INSTANCE: job,
        LABEL_COMPONENT: role,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_JOB: job,
        LABEL_ROLE: role,
    }


def agent_selector(job: str) -> dict[str, str]:
    """Labels that select exactly the agent pods of ``job``."""
    return {LABEL_JOB: job, LABEL_ROLE: ROLE_AGENT}


#: Labels of a TrainingJob copied to its pods: Kueue's queue and priority class.
PASSED_LABELS = ("kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class")


def passed_labels(body: dict[str, Any]) -> dict[str, str]:
    """The TrainingJob's labels that its pods carry too (:data:`PASSED_LABELS`).

    Only copied: nothing in ringmaster talks to Kueue, and Kueue has no
    integration for the TrainingJob kind, so it does not admit a TrainingJob.
    What the labels do on the pods depends on the cluster's own Kueue setup
    (untried here).  A pod template may not set them (:mod:`.template`).
    """
    job_labels = (body.get("metadata") or {}).get("labels") or {}
    return {k: str(job_labels[k]) for k in PASSED_LABELS if k in job_labels}


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """An owner reference to the TrainingJob ``body`` (garbage collection on delete)."""
    meta = body["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_meta(body: dict[str, Any], name: str, role: str) -> dict[str, Any]:
    """``metadata`` of a child: name, namespace, labels, owner reference."""
    meta = body["metadata"]
    return {
        "name": name,
        "namespace": meta.get("namespace", "default"),
        "labels": labels(meta["name"], role),
        "ownerReferences": [owner_reference(body)],
    }
