"""Contracts of the control plane: its errors and the job phases.

The job spec tree is in :mod:`orchestrator.spec.job`, the records stored in etcd
in :mod:`orchestrator.state.records`.  Retryable errors (:class:`EtcdUnavailableError`:
the cluster may come back) are apart from permanent ones
(:class:`EtcdAuthError`, :class:`~orchestrator.spec.api.SpecError`).
"""

from __future__ import annotations

from datetime import timedelta
from enum import Enum

# --------------------------------------------------------------------------- errors


class OrchestratorError(Exception):
    """Base of every error raised by the ``orchestrator`` package."""


class PackageClashError(OrchestratorError):
    """Another distribution's top-level package shadows one of ringmaster's
    (``agents``, ``checkpoint`` or ``orchestrator``).  Permanent: the
    environment must change."""


class EtcdError(OrchestratorError):
    """Base of errors talking to etcd."""


class EtcdUnavailableError(EtcdError):
    """No etcd endpoint answered in time.  Retryable: the cluster may come back."""

    def __init__(self, endpoints: list[str], timeout: timedelta, reasons: dict[str, str]) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.reasons = dict(reasons)
        tried = "; ".join(f"{ep} ({reasons.get(ep, 'no answer')})" for ep in endpoints)
        super().__init__(
            f"could not reach etcd within {timeout.total_seconds():g}s; tried {tried}. "
            "Check that etcd is running and that --etcd / RINGMASTER_ETCD lists its client "
            "endpoints as host:port (or https://host:port with TLS options)."
        )


class EtcdAuthError(EtcdError):
    """etcd refused the credentials or TLS identity.  Permanent until the config changes."""


class JobNotFoundError(OrchestratorError):
    """No job of that name in etcd (or no run of that number)."""


class EmbeddedEtcdError(OrchestratorError):
    """The local etcd binary could not be found or did not start."""


# --------------------------------------------------------------------------- phases


class JobPhase(str, Enum):
    """Lifecycle of a job as recorded by the controller.

    Transitions::

        Pending ──► Running ◄──► Recovering
           │           │  ▲          │  ▲
           │           ▼  │          ▼  │
           │          Paused ◄───────┘──┘
           ▼           │ │             │
        Stopped   Succeeded | Failed | Stopped

    ``Paused``: the control plane (etcd) was unreachable; workers keep their
    state at a step boundary and the controller declares no failures until a
    grace period after etcd is back.  ``Succeeded``, ``Failed`` and
    ``Stopped`` are terminal.
    """

    PENDING = "Pending"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    PAUSED = "Paused"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"

    @property
    def terminal(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)

    def can_move_to(self, other: JobPhase) -> bool:
        return other in _PHASE_TRANSITIONS[self]


_PHASE_TRANSITIONS: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.PENDING: frozenset({JobPhase.RUNNING, JobPhase.FAILED, JobPhase.STOPPED}),
    JobPhase.RUNNING: frozenset(
        {
            JobPhase.RECOVERING,
            JobPhase.PAUSED,
            JobPhase.SUCCEEDED,
            JobPhase.FAILED,
            JobPhase.STOPPED,
        }
    ),
    JobPhase.RECOVERING: frozenset(
        {JobPhase.RUNNING, JobPhase.PAUSED, JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED}
    ),
    JobPhase.PAUSED: frozenset(
        {
            JobPhase.RUNNING,
            JobPhase.RECOVERING,
            JobPhase.SUCCEEDED,
            JobPhase.FAILED,
            JobPhase.STOPPED,
        }
    ),
    JobPhase.SUCCEEDED: frozenset(),
    JobPhase.FAILED: frozenset(),
    JobPhase.STOPPED: frozenset(),
}
