"""Job records in etcd: submit, resume, read status, list, request a stop.

These are the library calls behind ``ringmaster submit/resume/status/stop``;
the controller writes the status and events, this module only reads them (and
writes the spec and the stop command, which are the user's to write).

A resumed job is submitted again with a :class:`ResumeRequest` in its spec
record: the checkpoint directory its workers load when they start without any
live state (see ``agents.runtime``).  The request is checked here, before
anything starts: the checkpoint must be reachable and committed, and saved by
a job of the same :func:`checkpoint_hash` unless forced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

from orchestrator.api import EtcdError, JobNotFoundError
from orchestrator.etcd.client import EtcdClient
from orchestrator.spec.job import JobSpec
from orchestrator.state import events, keys, records
from orchestrator.state.api import CheckpointStorageRefusedError, JobExistsError, ResumeRefusedError
from orchestrator.state.port_credential import ensure_token
from orchestrator.state.records import (
    CommandRecord,
    JobStatus,
    ResumeRequest,
    RunRecord,
    SpecRecord,
)

__all__ = [
    "JobNotFoundError",
    "checkpoint_hash",
    "etcd_warning",
    "job_names",
    "list_jobs",
    "load_spec",
    "plan_resume",
    "read_resume",
    "read_run",
    "read_spec",
    "read_spec_record",
    "read_status",
    "request_stop",
    "resume",
    "send_command",
    "spec_hash",
    "submit",
    "undecided",
    "undecided_for",
]

log = logging.getLogger(__name__)


def check_checkpoint_url(spec: JobSpec, storage_options: dict[str, Any] | None = None) -> None:
    """Write, read back and delete a probe object under ``checkpoint.url``.

    ``ringmaster run`` calls it before any worker starts, so a read-only
    directory, a missing bucket or an endpoint that does not answer refuses
    the run at once (the workers would only find out at their first save).
    Credentials come from ``storage_options`` or the usual places of the
    fsspec backend, as the workers' do.

    Raises:
        CheckpointStorageRefusedError: one line naming the URL and the cause.
    """
    import fsspec

    url = spec.checkpoint.url
    if "://" not in url:
        url = f"file://{os.path.abspath(url)}"
    try:
        # a fresh filesystem: fsspec's cached one may carry an older endpoint or
        # credentials than this process's environment now gives
        options = {"skip_instance_cache": True, **(storage_options or {})}
        fs, root = fsspec.core.url_to_fs(url, **options)
        probe = f"{str(root).rstrip('/')}/.ringmaster-probe-run-{os.getpid()}"
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"ok")
        if fs.cat_file(probe) != b"ok":
            raise OSError("the probe object read back differently")
        fs.rm_file(probe)
    except Exception as e:  # whatever the backend raises: the run cannot save there
        cause = " ".join(f"{type(e).__name__}: {e}".split())
        raise CheckpointStorageRefusedError(
            f"checkpoint.url {url} is not writable ({cause}); point checkpoint.url at a place "
            "this machine can write (check the path, the bucket, the endpoint and credentials)"
        ) from e


def spec_hash(spec: JobSpec) -> str:
    """A stable hash of the whole spec (the submitted record carries it)."""
    return hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_hash(spec: JobSpec) -> str:
    """Hash of the parts of a spec that shape the saved state, recorded in checkpoints.

    The entrypoint (script or module, and its arguments) and the gradient
    compression (its state is saved per rank).  Node counts, checkpoint
    settings, timeouts and resources are left out: changing them between
    runs is what resuming is for.
    """
    entry = spec.entrypoint
    shaping = {
        "script": entry.script,
        "module": entry.module,
        "args": list(entry.args),
        "compression": spec.to_dict()["comm"]["compression"],
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def plan_resume(
    spec: JobSpec,
    from_url: str | None = None,
    *,
    force: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> ResumeRequest:
    """Pick and check the checkpoint a run of ``spec`` resumes from.

    Args:
        spec: the job to resume.
        from_url: a checkpoint directory or root; default the job's own
            ``checkpoint.url`` (its newest committed checkpoint).
        force: accept a checkpoint saved by a job of another :func:`checkpoint_hash`.
        storage_options: fsspec options (default: the usual AWS/fsspec places).

    Raises:
        ResumeRefusedError: unreachable storage, nothing committed there, or
            a checkpoint of another job (without ``force``); the message says
            which and what to do.
    """
    from checkpoint import CheckpointError
    from checkpoint.catalog import check_spec_hash, resume_point, scrub

    url = from_url or spec.checkpoint.url
    if "://" not in url:
        url = f"file://{os.path.abspath(url)}"
    try:
        info = resume_point(url, storage_options)
        check_spec_hash(info, checkpoint_hash(spec), force=force)
    except CheckpointError as e:
        raise ResumeRefusedError(f"cannot resume job '{spec.name}': {scrub(str(e))}") from e
    assert info.manifest is not None
    newest = info.url.rstrip("/") != url.rstrip("/")  # a root was given: its newest
    return ResumeRequest(info.url, info.step, info.manifest.world_size, newest=newest)


def submit(
    client: EtcdClient,
    spec: JobSpec,
    *,
    replace_finished: bool = True,
    resume: ResumeRequest | None = None,
) -> int:
    """Write a validated spec under ``/ringmaster/jobs/<job>/spec``; returns the run number.

    A job name has runs: the first submit starts run 1.  Submitting the name
    of a finished job (stopped, failed or succeeded) again starts its next
    run: what belonged to the last run (its plan, status, nodes, progress,
    commands) is cleared, while the job's events, logs, history, recoveries
    and run records stay readable.  The job's port credential (what its agents
    ask of every request but the liveness status, :mod:`orchestrator.state.port_credential`)
    is created at its first submit and kept.

    Args:
        client: etcd.
        spec: the job.
        replace_finished: start a new run of a finished job of the same name
            (otherwise a finished job's name is refused like an active one).
        resume: the checkpoint its workers start from (see :func:`plan_resume`).

    Raises:
        JobExistsError: a job of that name exists and has not finished.
    """
    spec.validate()
    # before the spec: an agent that sees the spec finds its port's credential there too
    ensure_token(client, spec.name)
    record = SpecRecord(
        spec=spec.to_dict(), hash=spec_hash(spec), submitted_at=time.time(), resume=resume
    )
    if client.create(keys.job_spec(spec.name), record.encode()):
        _start_run(client, spec.name, record)
        return record.run
    previous = records.read(client, keys.job_spec(spec.name), SpecRecord)
    status = read_status(client, spec.name)
    if status is not None and status.phase.terminal and replace_finished:
        for key in keys.run_state(spec.name):
            if key.endswith("/"):
                client.delete_prefix(key)
            else:
                client.delete(key)
        record.run = (previous.run if previous is not None else status.run) + 1
        if client.create(keys.job_spec(spec.name), record.encode()):
            _start_run(client, spec.name, record)
            return record.run
        status = read_status(client, spec.name)  # another submit won the race
    phase = status.phase.value if status else "unknown"
    raise JobExistsError(
        f"job '{spec.name}' is already submitted (phase {phase}); stop it with "
        f"`ringmaster stop {spec.name}` or pick another name"
    )


def _start_run(client: EtcdClient, job: str, record: SpecRecord) -> None:
    run = RunRecord(run=record.run, submitted_at=record.submitted_at, resume=record.resume)
    records.write(client, keys.job_run(job, record.run), run)
    at = record.submitted_at  # no controller has led this run yet: it is undecided since
    status = JobStatus(job, run=record.run, submitted_at=at, updated_at=at, led_at=at)
    records.write(client, keys.job_status(job), status)
    message = f"run {record.run} submitted"
    if record.resume is not None:
        resume = record.resume
        message += f", resuming from the checkpoint of step {resume.step} ({resume.url})"
    events.emit(client, job, "Run", message, source="submit", run=record.run)


def read_spec(client: EtcdClient, job: str) -> tuple[JobSpec, str]:
    """The submitted spec and its hash.

    Raises:
        JobNotFoundError: nothing submitted under that name.
    """
    record = read_spec_record(client, job)
    return load_spec(record, job), record.hash


def load_spec(record: SpecRecord, job: str) -> JobSpec:
    """The spec of a submitted record (validated as a job file is)."""
    from orchestrator.spec.loader import load_job_data

    return load_job_data(record.spec, source=f"etcd:{keys.job_spec(job)}")


def read_run(client: EtcdClient, job: str) -> tuple[SpecRecord, JobStatus | None] | None:
    """The submitted record and the job's status, read at one revision.

    The record's ``run`` says which run was submitted last; the status says how far
    that run got (its ``run`` differs while a resubmit is under way).  None when
    nothing is submitted under that name.

    Raises:
        RecordError: a stored record is malformed.
    """
    spec_key, status_key = keys.job_spec(job), keys.job_status(job)
    found = client.get_many([spec_key, status_key])
    if spec_key not in found:
        return None
    record = records.decode(SpecRecord, found[spec_key].value, spec_key)
    status = found.get(status_key)
    return record, None if status is None else records.decode(JobStatus, status.value, status_key)


def read_spec_record(client: EtcdClient, job: str) -> SpecRecord:
    """The submitted record: spec, hash, submission time, resume point.

    Raises:
        JobNotFoundError: nothing submitted under that name.
        RecordError: the stored record is malformed.
    """
    record = records.read(client, keys.job_spec(job), SpecRecord)
    if record is None:
        raise JobNotFoundError(f"no job named '{job}' (see `ringmaster status` for all jobs)")
    return record


def read_resume(client: EtcdClient, job: str) -> ResumeRequest | None:
    """The checkpoint a resubmitted job starts from, if it was resumed."""
    record = records.read(client, keys.job_spec(job), SpecRecord)
    return None if record is None else record.resume


def resume(
    client: EtcdClient,
    job: str,
    from_url: str | None = None,
    *,
    force: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> ResumeRequest:
    """Resubmit a finished (stopped, failed or succeeded) job from a checkpoint.

    Its stored spec is submitted again; the workers load the newest committed
    checkpoint under its ``checkpoint.url`` (or the one given) on whatever
    world size the new run gets.

    Raises:
        JobNotFoundError: nothing submitted under that name.
        ResumeRefusedError: the job is still active, or the checkpoint is
            unusable (see :func:`plan_resume`).
    """
    spec, _ = read_spec(client, job)
    status = read_status(client, job)
    if status is not None and not status.phase.terminal:
        raise ResumeRefusedError(
            f"job '{job}' is {status.phase.value}; only a stopped, failed or finished job can "
            f"be resumed (stop it first with `ringmaster stop {job}`)"
        )
    request = plan_resume(spec, from_url, force=force, storage_options=storage_options)
    submit(client, spec, resume=request)
    return request


def read_status(client: EtcdClient, job: str) -> JobStatus | None:
    return records.read(client, keys.job_status(job), JobStatus)


def job_names(client: EtcdClient) -> list[str]:
    """The name of every job in etcd, sorted.

    Lists names only (:meth:`~orchestrator.etcd.client.EtcdClient.child_names`):
    no value under ``/ringmaster/jobs/`` is read, and not every key either.
    """
    return [n for n in client.child_names(keys.jobs_prefix()) if n]


def list_jobs(client: EtcdClient) -> list[JobStatus]:
    """Status of every job, sorted by name.

    Reads the job names, then their status records at one revision: not the
    jobs' events, logs, progress or history.
    """
    names = job_names(client)
    found = client.get_many([keys.job_status(n) for n in names])
    out = [records.decode(JobStatus, kv.value, kv.key) for kv in found.values()]
    return sorted(out, key=lambda s: s.name)


#: ``ringmaster status`` says that nothing decides a job once no controller led it for
#: longer than this (a leader rewrites the status every couple of seconds; its lease
#: lasts RINGMASTER_LEADER_TTL, 3 s, past its death).
UNDECIDED_AFTER_S = 5.0


def undecided_for(status: JobStatus, leader: str | None, now: float) -> float | None:
    """Seconds no controller has led the job, once past :data:`UNDECIDED_AFTER_S` (else None).

    Nobody leads a job when its election key is empty (``leader`` None); how
    long since is the age of the last status a leader wrote (``led_at``, the
    submit's time until one did).  A job that is over needs nobody.
    """
    if status.phase.terminal or leader is not None:
        return None
    since = status.led_at or status.updated_at or status.submitted_at
    if not since:
        return None
    age = now - since
    return age if age > UNDECIDED_AFTER_S else None


def undecided(client: EtcdClient, found: list[JobStatus]) -> dict[str, float]:
    """The jobs of ``found`` that no controller has led for a while: name → seconds.

    Reads the election key of each job not over (one range read); see :func:`undecided_for`.
    """
    active = [s for s in found if not s.phase.terminal]
    if not active:
        return {}
    leaders = client.get_many([keys.controller_leader(s.name) for s in active])
    now, out = time.time(), {}
    for s in active:
        kv = leaders.get(keys.controller_leader(s.name))
        seconds = undecided_for(s, kv.value.decode() if kv else None, now)
        if seconds is not None:
            out[s.name] = seconds
    return out


def etcd_warning(client: EtcdClient) -> str | None:
    """What is wrong with etcd's space, for `ringmaster status` (None when all is well).

    etcd out of space (its NOSPACE alarm), another alarm, or a database near
    its quota (:mod:`orchestrator.etcd.health`).  None too when etcd does not
    say (a user without the right to list alarms): the status is shown anyway.
    """
    from orchestrator.etcd.health import read_health

    try:
        return read_health(client).problem()
    except EtcdError as e:  # a user not allowed to read alarms: nothing to add to the status
        log.debug("etcd's space not read: %s", e)
        return None


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
    records.write(
        client, keys.job_commands(job) + f"{time.time_ns():020d}", CommandRecord(command, args)
    )
