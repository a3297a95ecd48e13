"""Job records in etcd: submit, read status, list, request a stop.

These are the library calls behind ``ringmaster submit/status/stop``; the
controller writes the status and events, this module only reads them (and
writes the spec and the stop command, which are the user's to write).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator import keys
from orchestrator.api import JobPhase, JobSpec, OrchestratorError
from orchestrator.etcd_client import EtcdClient


class JobExistsError(OrchestratorError):
    """A job of that name is already submitted (and not finished)."""


class JobNotFoundError(OrchestratorError):
    """No job of that name in etcd."""


def spec_hash(spec: JobSpec) -> str:
    """A stable hash of the spec, recorded in checkpoints to catch resumes of another job."""
    return hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class JobStatus:
    """What the controller reports about a job (``/ringmaster/jobs/<job>/status``)."""

    name: str
    phase: JobPhase = JobPhase.PENDING
    step: int = 0
    world_size: int = 0
    generation: int = 0
    active_nodes: list[str] = field(default_factory=list)
    spare_nodes: list[str] = field(default_factory=list)
    failed_nodes: list[str] = field(default_factory=list)
    recoveries: int = 0
    last_checkpoint: str | None = None
    last_checkpoint_at: float | None = None
    message: str = ""
    updated_at: float = 0.0
    # observability (orchestrator.job_observer)
    steps_per_s: float = 0.0
    samples_per_s: float | None = None
    loss: float | None = None
    submitted_at: float = 0.0
    train_started_at: float | None = None
    last_step_at: float | None = None
    finished_at: float | None = None
    productive_s: float = 0.0
    effective_fraction: float = 0.0
    last_recovery: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobStatus:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "phase" in known:
            known["phase"] = JobPhase(known["phase"])
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["last_recovery"] = dict(self.last_recovery) if self.last_recovery else None
        out["phase"] = self.phase.value
        return out


def submit(client: EtcdClient, spec: JobSpec, *, replace_finished: bool = True) -> None:
    """Write a validated spec under ``/ringmaster/jobs/<job>/spec``.

    Raises:
        JobExistsError: a job of that name exists and has not finished.
    """
    spec.validate()
    record = {"spec": spec.to_dict(), "hash": spec_hash(spec), "submitted_at": time.time()}
    if client.create(keys.job_spec(spec.name), json.dumps(record)):
        client.put_json(keys.job_status(spec.name), JobStatus(spec.name).to_dict())
        return
    status = read_status(client, spec.name)
    if status is not None and status.phase.terminal and replace_finished:
        client.delete_prefix(keys.job_prefix(spec.name))
        submit(client, spec, replace_finished=False)
        return
    phase = status.phase.value if status else "unknown"
    raise JobExistsError(
        f"job '{spec.name}' is already submitted (phase {phase}); stop it with "
        f"`ringmaster stop {spec.name}` or pick another name"
    )


def read_spec(client: EtcdClient, job: str) -> tuple[JobSpec, str]:
    """The submitted spec and its hash.

    Raises:
        JobNotFoundError: nothing submitted under that name.
    """
    from orchestrator.spec_loader import load_job_data

    record = client.get_json(keys.job_spec(job))
    if record is None:
        raise JobNotFoundError(f"no job named '{job}' (see `ringmaster status` for all jobs)")
    return load_job_data(record["spec"], source=f"etcd:{keys.job_spec(job)}"), record["hash"]


def read_status(client: EtcdClient, job: str) -> JobStatus | None:
    data = client.get_json(keys.job_status(job))
    return None if data is None else JobStatus.from_dict(data)


def list_jobs(client: EtcdClient) -> list[JobStatus]:
    """Status of every job, sorted by name."""
    out = []
    for kv in client.get_prefix(keys.jobs_prefix()):
        if kv.key.endswith("/status"):
            out.append(JobStatus.from_dict(json.loads(kv.value)))
    return sorted(out, key=lambda s: s.name)


def request_stop(client: EtcdClient, job: str) -> None:
    """Ask the controller to stop a job (it saves a checkpoint first when it can).

    Raises:
        JobNotFoundError: nothing submitted under that name.
    """
    if client.get(keys.job_spec(job)) is None:
        raise JobNotFoundError(f"no job named '{job}'")
    send_command(client, job, "stop")


def send_command(client: EtcdClient, job: str, command: str, **args: Any) -> None:
    """Append a command for the controller (``checkpoint``, ``drain``, ``stop``)."""
    client.put_json(
        keys.job_commands(job) + f"{time.time_ns():020d}",
        {"command": command, "args": args, "at": time.time()},
    )
