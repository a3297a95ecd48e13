"""A job's runs: the record of each submit, and the span of time each one covers.

A job name has runs (see :func:`orchestrator.state.jobs.submit`): every submit of a
finished job starts the next one and writes a :class:`RunRecord` under
``/ringmaster/jobs/<job>/runs/<run>``.  Readers that show one run (events,
logs, history) keep what falls inside its window.  Runs in whichever process
reads them: the CLI, the controller, the observers, the workers.

A job's runs in one etcd make one *lineage* (:func:`lineage_id`): the
checkpoints they save carry it, and the run that writes a checkpoint root
holds it under that name (:mod:`orchestrator.checkpoint_root.writer_hold`).
"""

from __future__ import annotations

from orchestrator.api import JobNotFoundError
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys, records
from orchestrator.state.records import RunRecord, SpecRecord

__all__ = ["lineage_id", "list_runs", "run_window"]


def list_runs(client: EtcdClient, job: str) -> list[RunRecord]:
    """Every run of ``job``, oldest first."""
    return sorted(
        records.read_all(client, keys.job_runs(job), RunRecord).values(), key=lambda r: r.run
    )


def lineage_id(client: EtcdClient, job: str) -> str:
    """The job's lineage: ``<job>@<its first run's submission time>``.

    Every run of the job in this etcd (a resubmit, ``ringmaster resume``)
    continues it; another job of the same name (a second ``ringmaster run``
    with an etcd of its own) is another lineage.

    Raises:
        JobNotFoundError: nothing submitted under that name.
    """
    runs = list_runs(client, job)
    if runs:
        first = runs[0].submitted_at
    else:  # a job submitted before runs were recorded
        record = records.read(client, keys.job_spec(job), SpecRecord)
        if record is None:
            raise JobNotFoundError(f"no job named '{job}' (see `ringmaster status` for all jobs)")
        first = record.submitted_at
    return f"{job}@{first:.6f}"


def run_window(runs: list[RunRecord], run: int) -> tuple[float, float]:
    """Wall-clock span of ``run``: from its submit to the next run's (or forever).

    Raises:
        JobNotFoundError: the job has no such run; the message lists the runs.
    """
    for i, r in enumerate(runs):
        if r.run == run:
            end = runs[i + 1].submitted_at if i + 1 < len(runs) else float("inf")
            return r.submitted_at, end
    known = ", ".join(str(r.run) for r in runs) or "none"
    raise JobNotFoundError(f"the job has no run {run} (runs: {known})")
