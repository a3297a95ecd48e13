"""The TrainingJob ``status``: the controller's record in etcd, mapped for Kubernetes.

The controller writes ``/ringmaster/jobs/<job>/status`` as JSON (the fields of
:class:`orchestrator.state.jobs.JobStatus`: ``phase``, ``step``, ``world_size``,
``generation``, ``active_nodes``, ``spare_nodes``, ``failed_nodes``,
``recoveries``, ``last_checkpoint``, ``message``, ``updated_at``).  Node ids
are pod names (agents register under ``RINGMASTER_NODE`` = the pod name),
so ``active_nodes`` becomes ``activePods``.  The operator adds what only it
knows: desired and ready pod counts, pods it replaced, and the conditions.

Conditions (``type``: meaning when ``True``):

* ``Ready``: the job is training (phase Running).
* ``Recovering``: a node was lost and the job is re-forming.
* ``SparesAvailable``: at least ``nodes.spares`` warm spares are registered.
* ``Finished``: the job reached a terminal phase (reason = the phase).
* ``SpecValid``: the spec passed the job spec loader (``False`` = phase Invalid).
* ``Suspended``: ``spec.suspend`` is true (phase Suspended); the message says
  whether agent pods are still saving a checkpoint and leaving.

``completionTime`` is when the phase first became terminal (what
``ttlSecondsAfterFinished`` counts from).

A condition keeps its ``lastTransitionTime`` until its status changes.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from orchestrator.api import JobPhase
from orchestrator.spec.job import JobSpec

INVALID_PHASE = "Invalid"
SUSPENDED_PHASE = "Suspended"


def rfc3339(when: datetime) -> str:
    """``2026-01-02T03:04:05Z`` (what Kubernetes expects in date-time fields)."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 time as :func:`rfc3339` writes it, or None."""
    if not value:
        return None
    try:
        return datetime.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def pod_ready(pod: dict[str, Any]) -> bool:
    """True when the pod's ``Ready`` condition is ``True``."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def controller_phase(controller: dict[str, Any] | None) -> JobPhase | None:
    """The phase in the controller's record, or None when there is none (or it is unknown)."""
    if not controller:
        return None
    try:
        return JobPhase(controller.get("phase", JobPhase.PENDING.value))
    except ValueError:
        return None


def condition(
    old: list[dict[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int,
) -> dict[str, Any]:
    """A condition, keeping the old ``lastTransitionTime`` when the status did not change."""
    value = "True" if status else "False"
    previous = next((c for c in old if c.get("type") == type_), None)
    since = (
        previous["lastTransitionTime"]
        if previous and previous.get("status") == value and previous.get("lastTransitionTime")
        else rfc3339(now)
    )
    return {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def build_status(
    *,
    spec: JobSpec,
    controller: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    old: dict[str, Any],
    generation: int,
    now: datetime,
    desired_pods: int,
    replaced: int,
    next_index: int,
    suspended: bool = False,
    saving: int = 0,
) -> dict[str, Any]:
    """The full status of a valid TrainingJob.

    Args:
        spec: the job's validated spec.
        controller: the controller's status record from etcd, or None if not written yet.
        pods: the job's agent pods as observed (after this round's deletions are decided).
        old: the current ``status`` of the TrainingJob.
        generation: ``metadata.generation`` of the TrainingJob.
        now: the time to stamp on changed conditions.
        desired_pods: how many agent pods the job should have.
        replaced: pods replaced in this round (added to the running total).
        next_index: the index the next new agent pod gets.
        suspended: ``spec.suspend`` holds (and the job is not finished): phase Suspended.
        saving: while suspending, the agent pods still saving a checkpoint and leaving.
    """
    rec = controller or {}
    phase = controller_phase(controller) or JobPhase.PENDING
    active = [str(n) for n in rec.get("active_nodes") or []]
    spares = [str(n) for n in rec.get("spare_nodes") or []]
    old_conditions = list(old.get("conditions") or [])
    ready_pods = sum(1 for p in pods if pod_ready(p))

    def cond(type_: str, status: bool, reason: str, message: str) -> dict[str, Any]:
        return condition(
            old_conditions, type_, status, reason, message, now=now, generation=generation
        )

    want_spares = spec.nodes.spares
    if saving:
        suspend_message = (
            f"spec.suspend is true: {saving} agent pod(s) are saving a checkpoint and "
            "leaving; the controller stays until they are gone"
        )
    else:
        suspend_message = "spec.suspend is true: no pods run; the job's state is kept"
    conditions = [
        cond("SpecValid", True, "Valid", "the spec passed validation"),
        cond(
            "Ready",
            phase is JobPhase.RUNNING,
            phase.value,
            f"training on {len(active)} node(s), world size {int(rec.get('world_size', 0))}",
        ),
        cond(
            "Recovering",
            phase is JobPhase.RECOVERING,
            phase.value,
            str(rec.get("message", "")) if phase is JobPhase.RECOVERING else "",
        ),
        cond(
            "SparesAvailable",
            len(spares) >= want_spares,
            "Enough" if len(spares) >= want_spares else "TooFew",
            f"{len(spares)} of {want_spares} spare(s) registered",
        ),
        cond(
            "Finished",
            phase.terminal,
            phase.value,
            str(rec.get("message", "")) if phase.terminal else "",
        ),
        cond(
            "Suspended",
            suspended,
            "Suspended" if suspended else "NotSuspended",
            suspend_message if suspended else "",
        ),
    ]
    status: dict[str, Any] = {
        "phase": SUSPENDED_PHASE if suspended else phase.value,
        "step": int(rec.get("step", 0)),
        "worldSize": int(rec.get("world_size", 0)),
        "generation": int(rec.get("generation", 0)),
        "activePods": active,
        "sparePods": spares,
        "failedPods": [str(n) for n in rec.get("failed_nodes") or []],
        "activeCount": len(active),
        "spareCount": len(spares),
        "desiredPods": desired_pods,
        "readyPods": ready_pods,
        "replacedPods": int(old.get("replacedPods", 0)) + replaced,
        "nextPodIndex": next_index,
        "recoveries": int(rec.get("recoveries", 0)),
        "message": str(rec.get("message", "")),
        "observedGeneration": generation,
        "conditions": conditions,
    }
    if phase.terminal:
        status["completionTime"] = old.get("completionTime") or rfc3339(now)
    elif old.get("completionTime"):
        status["completionTime"] = None  # run again: a merge patch with null removes it
    if rec.get("last_checkpoint"):
        status["lastCheckpoint"] = str(rec["last_checkpoint"])
    if rec.get("updated_at"):
        stamp = datetime.fromtimestamp(float(rec["updated_at"]), tz=timezone.utc)
        status["updatedAt"] = rfc3339(stamp)
    return status


def invalid_status(
    old: dict[str, Any], message: str, *, generation: int, now: datetime
) -> dict[str, Any]:
    """Status of a TrainingJob whose spec the loader rejected: phase Invalid, the reason."""
    old_conditions = list(old.get("conditions") or [])
    out = dict(old)
    out.update(
        phase=INVALID_PHASE,
        message=message,
        observedGeneration=generation,
        conditions=[
            condition(
                old_conditions,
                "SpecValid",
                False,
                "Invalid",
                message,
                now=now,
                generation=generation,
            )
        ]
        + [c for c in old_conditions if c.get("type") != "SpecValid"],
    )
    return out
