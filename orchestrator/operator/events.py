"""Kubernetes Events on a TrainingJob, decided from the status before and after a sync.

``kubectl describe trainingjob NAME`` shows them.  The function is pure: it
compares the old status (what the TrainingJob carries) with the new one (what
this sync writes) and looks at the pods this sync deletes, so each change is
reported once, by the sync that first sees it.

| reason | type | when |
| --- | --- | --- |
| ``PodFailed`` | Warning | an agent pod failed (evicted, preempted, crashed) and is replaced |
| ``NodeFailed`` | Warning | the controller newly lists a pod as failed (not while suspending) |
| ``Recovering`` | Warning | the job entered phase Recovering (not on a resume) |
| ``Recovered`` | Normal | the recovery count went up (not while suspending) |
| ``Checkpoint`` | Normal | a newer committed checkpoint |
| ``Succeeded`` / ``Failed`` | Normal / Warning | the job reached a terminal phase |
| ``Suspended`` / ``Resumed`` | Normal | ``spec.suspend`` took effect / was cleared |
| ``Expired`` | Normal | ``ttlSecondsAfterFinished`` passed: the TrainingJob is deleted |
| ``InvalidSpec`` | Warning | the spec or its template was rejected (a new message) |
"""

from __future__ import annotations

from typing import Any

from orchestrator.operator.api import Deletion, JobEvent

NORMAL = "Normal"
WARNING = "Warning"
SUSPENDED_PHASE = "Suspended"
_TERMINAL = {"Succeeded": NORMAL, "Failed": WARNING}


def sync_events(
    old: dict[str, Any], new: dict[str, Any], deletions: list[Deletion]
) -> list[JobEvent]:
    """The events one sync posts (see the module's table)."""
    out: list[JobEvent] = []
    for gone in deletions:
        if gone.kind == "Pod" and gone.reason.startswith("pod failed"):
            out.append(JobEvent(WARNING, "PodFailed", f"{gone.name}: {gone.reason}; replacing it"))
        if gone.kind == "TrainingJob":
            out.append(JobEvent(NORMAL, "Expired", gone.reason))
    phase, was = new.get("phase"), old.get("phase")
    # Suspending: the pods leave on purpose, and the controller sees them go
    # (nodes lost, a spare swapped in) until the last one has left: no failures.
    suspending = phase == SUSPENDED_PHASE
    before = set(old.get("failedPods") or [])
    for pod in new.get("failedPods") or []:
        if pod not in before and not suspending:
            out.append(JobEvent(WARNING, "NodeFailed", f"the controller lost {pod}"))
    message = str(new.get("message") or "")
    if phase == "Recovering" and was not in ("Recovering", SUSPENDED_PHASE):
        out.append(JobEvent(WARNING, "Recovering", message or "a node was lost; re-forming"))
    recoveries, had = int(new.get("recoveries") or 0), int(old.get("recoveries") or 0)
    if recoveries > had and not suspending:
        out.append(
            JobEvent(
                NORMAL,
                "Recovered",
                f"recovery {recoveries} done: training on world size "
                f"{int(new.get('worldSize') or 0)} at step {int(new.get('step') or 0)}",
            )
        )
    checkpoint = new.get("lastCheckpoint")
    if checkpoint and checkpoint != old.get("lastCheckpoint"):
        out.append(JobEvent(NORMAL, "Checkpoint", f"committed {checkpoint}"))
    if phase in _TERMINAL and was != phase:
        text = f"the job {phase.lower()} at step {int(new.get('step') or 0)}"
        out.append(JobEvent(_TERMINAL[phase], phase, f"{text}: {message}" if message else text))
    if phase == SUSPENDED_PHASE and was != SUSPENDED_PHASE:
        out.append(
            JobEvent(
                NORMAL,
                "Suspended",
                "spec.suspend is true: the job's pods save a checkpoint and leave",
            )
        )
    if was == SUSPENDED_PHASE and phase != SUSPENDED_PHASE:
        out.append(JobEvent(NORMAL, "Resumed", "spec.suspend is false: the job's pods return"))
    return out


def invalid_event(old: dict[str, Any], message: str) -> list[JobEvent]:
    """``InvalidSpec`` once per new rejection message."""
    if old.get("phase") == "Invalid" and old.get("message") == message:
        return []
    return [JobEvent(WARNING, "InvalidSpec", message)]
