"""Looking at a job: its event log, a live view, and the HTML report."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

import click
from rich.markup import escape

from orchestrator.cli.options import (
    column,
    connect_client,
    console,
    etcd_options,
    handle_errors,
    json_option,
    plural,
    print_table,
    table,
    wide_option,
)
from orchestrator.observe.training_time import effective_summary
from orchestrator.state import events, jobs, keys


def effective_line(status: jobs.JobStatus) -> str:
    """Effective training beside the start-up, failures and checkpoint stalls (the
    status's split of the time), or the effective training alone from an older status."""
    if status.training_time is None or status.train_started_at is None:
        return f"effective training {status.effective_fraction:.1%}"
    return effective_summary(status.training_time)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


@click.command("events")
@click.argument("job")
@json_option
@wide_option
@click.option("--type", "types", multiple=True, help="only events of this type (repeatable)")
@click.option("--run", "run", type=int, help="only this run of the job (default: every run)")
@etcd_options
@handle_errors
def events_cmd(
    job: str, as_json: bool, wide: bool, types: tuple[str, ...], run: int | None, **kw: Any
) -> None:
    """List a job's events: membership, failures (with cause), recoveries, checkpoints, phases.

    Messages wrap between words to fit the terminal; ``--wide`` prints one
    line per event.
    """
    with connect_client(kw) as client:
        if client.get(keys.job_spec(job)) is None:
            raise jobs.JobNotFoundError(f"no job named '{job}'")
        log = events.list_events(client, job, run=run)
    if types:
        log = [ev for ev in log if ev.type in types]
    if as_json:
        for ev in log:
            click.echo(json.dumps(asdict(ev), sort_keys=True))
        return
    from orchestrator.observe.live_view import FAILURE_EVENTS, RECOVERY_EVENTS

    out = table(
        column("time", wrap=False),
        column("type", wrap=False),
        column("source"),
        column("message"),
    )
    for ev in log:
        style = (
            "red" if ev.type in FAILURE_EVENTS else "green" if ev.type in RECOVERY_EVENTS else None
        )
        out.add_row(
            _clock(ev.time), escape(ev.type), escape(ev.source), escape(ev.message), style=style
        )
    print_table(out, wide)


@click.command()
@click.argument("job")
@click.option(
    "-o",
    "--output",
    default="report.html",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="the HTML report; the PNG is written beside it (same name, .png)",
)
@click.option(
    "--png", "png_path", type=click.Path(dir_okay=False), help="write the PNG here instead"
)
@etcd_options
@handle_errors
def report(job: str, output: str, png_path: str | None, **kw: Any) -> None:
    """Write an HTML report (loss, throughput, failures, recoveries) and a PNG."""
    from orchestrator.observe.report import write_report

    with connect_client(kw) as client:
        html_out, png_out, data = write_report(client, job, output, png_path)
    recoveries = plural(len(data.recoveries), "recovery", "recoveries")
    console.print(
        f"wrote {html_out} and {png_out}: {recoveries}, {effective_line(data.status)}",
        highlight=False,
        soft_wrap=True,
    )


@click.command()
@click.argument("job")
@click.option(
    "--interval", type=float, default=0.5, show_default=True, help="seconds between polls"
)
@etcd_options
@handle_errors
def watch(job: str, interval: float, **kw: Any) -> None:
    """Follow a job: a progress bar (step, rate, ETA, phase), failures and recoveries."""
    from orchestrator.observe.live_view import LiveView

    with connect_client(kw) as client:
        spec, _ = jobs.read_spec(client, job)
        seen = 0
        with LiveView(console, job, spec.max_steps) as view:
            while True:
                status = jobs.read_status(client, job)
                if status is None:
                    raise jobs.JobNotFoundError(f"job '{job}' disappeared while watching")
                log = events.list_events(client, job)
                for ev in log[seen:]:
                    view.event(ev)
                seen = len(log)
                view.update(status)
                if status.phase.terminal:
                    break
                time.sleep(interval)
    console.print(
        f"{job}: {status.phase.value} at step {status.step}; "
        f"{plural(status.recoveries, 'recovery', 'recoveries')}; {effective_line(status)}",
        highlight=False,
        soft_wrap=True,
    )
