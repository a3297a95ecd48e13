"""Commands against a running cluster, through etcd: submit, status, stop."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from orchestrator import jobs
from orchestrator.cli.options import connect_client, console, etcd_options, handle_errors


@click.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@etcd_options
@handle_errors
def submit(job_file: str, **kw: Any) -> None:
    """Submit a job to the cluster's controller through etcd."""
    from orchestrator.spec_loader import load_job_file

    spec = load_job_file(job_file)
    with connect_client(kw) as client:
        jobs.submit(client, spec)
    console.print(f"submitted job '{spec.name}'", highlight=False)


@click.command()
@click.argument("job", required=False)
@etcd_options
@handle_errors
def status(job: str | None, **kw: Any) -> None:
    """Show one job, or all jobs, as a table."""
    with connect_client(kw) as client:
        found = (
            [s for s in [jobs.read_status(client, job)] if s is not None]
            if job
            else jobs.list_jobs(client)
        )
    if job and not found:
        raise jobs.JobNotFoundError(f"no job named '{job}'")
    table = Table("job", "phase", "step", "world", "active", "spare", "recoveries", "checkpoint")
    for s in found:
        table.add_row(
            s.name,
            s.phase.value,
            str(s.step),
            str(s.world_size),
            ",".join(s.active_nodes) or "-",
            ",".join(s.spare_nodes) or "-",
            str(s.recoveries),
            s.last_checkpoint or "-",
        )
    console.print(table)


@click.command()
@click.argument("job")
@etcd_options
@handle_errors
def stop(job: str, **kw: Any) -> None:
    """Ask the controller to stop a job (after a final checkpoint)."""
    with connect_client(kw) as client:
        jobs.request_stop(client, job)
    console.print(f"stop requested for job '{job}'", highlight=False)
