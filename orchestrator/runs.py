"""A job's runs: the record of each submit, and the span of time each one covers.

A job name has runs (see :func:`orchestrator.jobs.submit`): every submit of a
finished job starts the next one and writes a :class:`RunRecord` under
``/ringmaster/jobs/<job>/runs/<run>``.  Readers that show one run (events,
logs, history) keep what falls inside its window.  Runs in whichever process
reads them: the CLI, the controller, the observers.
"""

from __future__ import annotations

from orchestrator import keys, records
from orchestrator.api import JobNotFoundError
from orchestrator.etcd.client import EtcdClient
from orchestrator.records import RunRecord

__all__ = ["list_runs", "run_window"]


def list_runs(client: EtcdClient, job: str) -> list[RunRecord]:
    """Every run of ``job``, oldest first."""
    return sorted(
        records.read_all(client, keys.job_runs(job), RunRecord).values(), key=lambda r: r.run
    )


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
