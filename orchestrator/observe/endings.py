"""The last words of a run that cannot go on: its cause, and only advice that would work.

When every node agent of ``ringmaster run`` has exited before the controller
ended the job, the job's phase still says what the controller last saw (often
``Recovering: lease expired``: the agents' leases ran out after they left).
The cause is elsewhere: in the first ``WorkerExited`` event that carries an
error (a worker that failed before it could report to the controller), or in
a storage fault the workers reported.  :func:`agents_gone_message` names it,
and suggests ``ringmaster resume`` only when the job committed a checkpoint
(otherwise there is nothing to resume from).  A job that finished while a
save was still uploading says which checkpoint lasts (:func:`unsaved`, in the
controller's final phase).  Pure; runs in the CLI and the controller.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.state.records import Event, JobStatus

__all__ = ["STORAGE_EVENTS", "agents_gone_message", "first_cause", "unsaved"]

#: Events of the workers' storage faults (:mod:`agents.runtime.storage_faults`).
STORAGE_EVENTS = ("CheckpointFailed", "CheckpointStalled", "CheckpointAbandoned")


def first_cause(events: Sequence[Event]) -> str | None:
    """The first worker error of ``events`` (a ``WorkerExited`` with an error), else the
    first storage fault, in the events' words; None when neither is there."""
    for ev in events:
        if ev.type == "WorkerExited" and ev.data.get("error"):
            return ev.message
    for ev in events:
        if ev.type in STORAGE_EVENTS:
            return ev.message
    return None


def agents_gone_message(job: str, status: JobStatus, events: Sequence[Event]) -> str:
    """What ``ringmaster run`` says when every node agent has exited (one line).

    Args:
        job: the job's name.
        status: the job's last status (its phase and newest committed checkpoint).
        events: the events of this run, oldest first.
    """
    cause = first_cause(events)
    said = f"the job is {status.phase.value} ({status.message})" if status.message else ""
    text = "every node agent has exited" + (f" and {said}" if said else "")
    text += ": it cannot go on here"
    if cause is not None:
        text += f"; the first error: {cause}"
        fixed = "once that is fixed, "
    else:
        text += "; no worker reported an error (were the agents stopped from outside?)"
        fixed = ""
    if status.last_checkpoint:
        text += (
            f"; {fixed}`ringmaster resume {job}` continues it from its newest checkpoint "
            f"({status.last_checkpoint})"
        )
    else:
        text += f"; it committed no checkpoint: {fixed}run it again to start it afresh"
    if cause is not None:
        text += f" (`ringmaster logs {job}` has the whole output)"
    return text


def unsaved(status: JobStatus, committed: int | None = None) -> str:
    """``"; step 60 was not saved, the newest durable checkpoint is step 50 (periodic)"``
    when a save was still uploading as the job ended (else "").

    ``committed``: the newest committed step: a save the workers last said was
    uploading may have committed since (their heartbeat came first).
    """
    if status.uploading is None or (committed is not None and committed >= status.uploading[0]):
        return ""
    newest = status.last_checkpoint or "none"
    return f"; step {status.uploading[0]} was not saved, the newest durable checkpoint is {newest}"
