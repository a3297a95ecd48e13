"""Commands against a running cluster, through etcd: submit, status, stop, logs."""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any

import click
from rich.table import Table

from orchestrator import jobs, keys
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


@click.command()
@click.argument("job")
@click.option("--node", help="only this node's workers")
@click.option("--tail", type=int, help="only the last N lines")
@click.option("--follow", "-f", is_flag=True, help="keep printing new lines (Ctrl-C to stop)")
@click.option("--timestamps", "-t", is_flag=True, help="prefix each line with its time")
@etcd_options
@handle_errors
def logs(
    job: str, node: str | None, tail: int | None, follow: bool, timestamps: bool, **kw: Any
) -> None:
    """Print the workers' output of a job, from etcd (also of nodes that died)."""
    from orchestrator.logs import LogLine, follow_logs, read_logs

    def show(line: LogLine) -> None:
        stamp = (
            datetime.fromtimestamp(line.time).strftime("%H:%M:%S.%f")[:-3] + " "
            if timestamps
            else ""
        )
        click.echo(f"{stamp}[{line.worker}] {line.text}")

    with connect_client(kw) as client:
        if jobs.read_status(client, job) is None and client.get(keys.job_spec(job)) is None:
            raise jobs.JobNotFoundError(f"no job named '{job}'")
        if not follow:
            for line in read_logs(client, job, node=node, tail=tail):
                show(line)
            return
        stop = threading.Event()
        try:
            for line in follow_logs(client, job, stop, node=node, tail=tail):
                show(line)
        except KeyboardInterrupt:
            stop.set()
