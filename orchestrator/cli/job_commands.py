"""Commands against a running cluster, through etcd: submit, status, stop, logs."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Any

import click
from rich.markup import escape
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
    if job:
        console.print(_one_job(found[0]))
        return
    table = Table(
        "job",
        "phase",
        "step",
        "rate",
        "world",
        "nodes a/s/f",
        "recoveries",
        "last checkpoint",
        "effective",
    )
    for s in found:
        rate = f"{s.steps_per_s:.1f} steps/s"
        if s.samples_per_s is not None:
            rate += f"\n{s.samples_per_s:.0f} samples/s"
        recoveries = str(s.recoveries)
        if s.last_recovery:
            last = s.last_recovery
            recoveries += f"\nlast: {last['cause']}, {last['total_s']:.2f}s"
        table.add_row(
            s.name,
            s.phase.value,
            str(s.step),
            rate,
            str(s.world_size),
            f"{len(s.active_nodes)}/{len(s.spare_nodes)}/{len(s.failed_nodes)}",
            recoveries,
            _checkpoint(s),
            f"{s.effective_fraction:.0%}" if s.train_started_at else "-",
        )
    console.print(table)


def _one_job(s: jobs.JobStatus) -> Table:
    """One job as a two-column table (readable on a narrow terminal)."""
    table = Table(show_header=False, title=f"job {s.name}", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rate = f"{s.steps_per_s:.2f} steps/s"
    if s.samples_per_s is not None:
        rate += f", {s.samples_per_s:.0f} samples/s"
    nodes = (
        f"{len(s.active_nodes)}/{len(s.spare_nodes)}/{len(s.failed_nodes)}  "
        f"(active {', '.join(s.active_nodes) or '-'}; spare {', '.join(s.spare_nodes) or '-'}; "
        f"failed {', '.join(s.failed_nodes) or '-'})"
    )
    rows = [
        ("phase", s.phase.value),
        ("step", str(s.step)),
        ("rate", rate),
        ("loss", "-" if s.loss is None else f"{s.loss:.4f}"),
        ("world size", f"{s.world_size} (generation {s.generation})"),
        ("nodes a/s/f", nodes),
        ("recoveries", str(s.recoveries)),
    ]
    if s.last_recovery:
        last = s.last_recovery
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in last["phases"].items())
        rows.append(("last recovery", f"{last['cause']}: {last['total_s']:.2f}s ({phases})"))
    rows += [
        ("last checkpoint", _checkpoint(s)),
        (
            "effective training",
            f"{s.effective_fraction:.0%} ({s.productive_s:.1f}s of progress)"
            if s.train_started_at
            else "-",
        ),
        ("message", s.message or "-"),
    ]
    for key, value in rows:
        table.add_row(key, escape(value))
    return table


def _checkpoint(s: jobs.JobStatus) -> str:
    if not s.last_checkpoint:
        return "-"
    if s.last_checkpoint_at is None:
        return s.last_checkpoint
    ago = max(0.0, time.time() - s.last_checkpoint_at)
    return f"{s.last_checkpoint}, {ago:.0f}s ago"


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
    from orchestrator.observe.logs import LogLine, follow_logs, read_logs

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
