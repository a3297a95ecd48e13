"""Commands against a running cluster, through etcd: submit, status, stop, logs."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import (
    column,
    connect_client,
    console,
    etcd_options,
    fail,
    handle_errors,
    json_option,
    print_table,
    table,
    wide_option,
)
from orchestrator.observe.job_observer import outer_loop_text
from orchestrator.observe.recoveries import ordered_phases, phase_label, restart_phases
from orchestrator.observe.training_time import seconds_text, time_rows
from orchestrator.state import jobs


@click.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--skip-entrypoint-check",
    is_flag=True,
    help="do not look for the entrypoint here (the agents run on machines with other files)",
)
@etcd_options
@handle_errors
def submit(job_file: str, skip_entrypoint_check: bool, **kw: Any) -> None:
    """Submit a job to the cluster's controller through etcd (--etcd, else the job
    file's rendezvous.endpoints with its tls, user and password_env).

    The entrypoint is looked for in this directory, where agents started here
    run their workers, and read to resolve ``fault_tolerance.recovery: auto``;
    in the restart tier, where the script keeps its own checkpoint goes into
    the job's events (a ``Warning`` when a node may not find it).
    A finished job's name starts its next run; the earlier runs' events, logs
    and history stay (``--run N`` on ``events`` and ``logs``).
    """
    import os

    from orchestrator.checkpoint_root.reach import record_event, script_checkpoint
    from orchestrator.spec.entrypoint import check_entrypoint, resolve_recovery
    from orchestrator.spec.job import RecoveryMode
    from orchestrator.spec.loader import load_job_file

    spec = load_job_file(job_file)
    found = None
    if not skip_entrypoint_check:
        check_entrypoint(spec, os.getcwd(), job_file)
        # without the check, fault_tolerance.recovery 'auto' is resolved by each agent
        spec, _ = resolve_recovery(spec, os.getcwd(), job_file)
        if spec.fault_tolerance.recovery is RecoveryMode.RESTART:
            found = script_checkpoint(spec, os.getcwd())
    with connect_client(kw, job=spec.rendezvous) as client:
        run = jobs.submit(client, spec)
        if found is not None:
            record_event(client, spec.name, found, source="submit")
    what = f"run {run} of job '{spec.name}'" if run > 1 else f"job '{spec.name}'"
    console.print(f"submitted {what}", highlight=False)
    if found is not None and found.warning:
        click.echo(f"warning: the script's checkpoint: {found.where}; {found.warning}", err=True)


@click.command()
@click.argument("job", required=False)
@wide_option
@json_option
@etcd_options
@handle_errors
def status(job: str | None, wide: bool, as_json: bool, **kw: Any) -> None:
    """Show one job, or all jobs, as a table.

    The table of all jobs fits an 80-column terminal; ``--wide`` adds the
    world size, throughput in samples, the last recovery and the message.
    A job that no controller has led for a few seconds is shown undecided
    (its phase and rate are the last a controller wrote), with a warning.
    """
    endpoints = kw.get("etcd_endpoints")  # read before connecting takes the options
    start = "ringmaster controller" + (f" --etcd {endpoints}" if endpoints else "")
    with connect_client(kw) as client:
        found = (
            [s for s in [jobs.read_status(client, job)] if s is not None]
            if job
            else jobs.list_jobs(client)
        )
        etcd_warning = jobs.etcd_warning(client)
        idle = jobs.undecided(client, found)
    if etcd_warning:  # on stderr: `status --json` stays one record a line
        click.echo(f"warning: {etcd_warning}", err=True)
    if job and not found:
        raise jobs.JobNotFoundError(f"no job named '{job}'")
    for name, seconds in idle.items():
        click.echo(f"warning: job {name}: {undecided_line(seconds, start)}", err=True)
    if as_json:
        for s in found:
            out = status_dict(s)
            if s.name in idle:
                out["undecided_s"] = round(idle[s.name], 1)
            click.echo(json.dumps(out))
        return
    if job:
        print_table(_one_job(found[0], idle.get(found[0].name)), wide)
    elif found:
        print_table(_jobs_table(found, wide, idle), wide)
    else:
        console.print("no jobs (submit one with `ringmaster submit job.yaml`)", highlight=False)


def undecided_line(seconds: float, start: str) -> str:
    """What ``status`` says of a job that no controller has led for ``seconds``."""
    return (
        f"no controller has led this job for {seconds:.0f} s: nothing is deciding "
        f"(its phase and rate are the last a controller wrote); start `{start}`"
    )


def status_dict(s: jobs.JobStatus) -> dict[str, Any]:
    """A status as JSON: the record's fields (as ``events --json``), recovery phases in order."""
    out = s.to_dict()
    out.pop("v", None)  # the storage format, not part of the status
    last = s.last_recovery
    if last and isinstance(last.get("phases"), dict):
        out["last_recovery"] = {**last, "phases": ordered_phases(last["phases"])}
    return out


def _jobs_table(found: list[jobs.JobStatus], wide: bool, idle: dict[str, float]) -> Table:
    """All jobs, one row each (``idle``: the jobs no controller leads, shown undecided).

    Made to fit 80 columns: the rate goes under the step, a header wraps
    between its words; ``wide`` gives the rate, samples/s and world size
    columns of their own, and adds the last recovery and the message.
    """
    columns = [column("job"), column("phase", wrap=False), column("step", justify="right")]
    if wide:
        columns += [
            column("steps/s", wrap=False, justify="right"),
            column("samples/s", wrap=False, justify="right"),
            column("world", wrap=False, justify="right"),
        ]
    nodes = "nodes a/s/f" if wide else "nodes\na/s/f"
    columns += [column(nodes), column("recoveries", wrap=False, justify="right")]
    if wide:
        columns.append(column("last recovery"))
    columns += [column("last checkpoint"), column("effective", wrap=False, justify="right")]
    if wide:
        columns.append(column("message"))
    out = table(*columns)
    for s in found:
        undecided = s.name in idle
        cells = [escape(s.name), f"{s.phase.value}, undecided" if undecided else s.phase.value]
        rate = "-" if undecided else f"{s.steps_per_s:.1f}"
        if wide:
            samples = "-" if s.samples_per_s is None or undecided else f"{s.samples_per_s:.0f}"
            cells += [str(s.step), rate, samples, str(s.world_size)]
        else:
            cells.append(f"{s.step}\n{rate}/s" if not undecided else f"{s.step}\n-")
        cells += [
            f"{len(s.active_nodes)}/{len(s.spare_nodes)}/{len(s.failed_nodes)}",
            str(s.recoveries),
        ]
        if wide:
            cells.append(escape(_last_recovery(s)))
        cells += [
            escape(checkpoint_cell(s)),
            f"{s.effective_fraction:.0%}" if s.train_started_at else "-",
        ]
        if wide:
            cells.append(escape(s.message or "-"))
        out.add_row(*cells)
    return out


def _one_job(s: jobs.JobStatus, undecided: float | None = None) -> Table:
    """One job as a two-column table (readable on a narrow terminal).

    ``undecided``: seconds no controller has led it (its phase and rate are stale).
    """
    out = table(column("", wrap=False), column(""), title=f"job {s.name}", show_header=False)
    out.columns[0].style = "bold"
    rate = f"{s.steps_per_s:.2f} steps/s"
    if s.samples_per_s is not None:
        rate += f", {s.samples_per_s:.0f} samples/s"
    phase = s.phase.value
    if undecided is not None:
        rate = "- (no controller measures it)"
        phase += f", undecided: no controller has led this job for {undecided:.0f} s"
    nodes = (
        f"{len(s.active_nodes)}/{len(s.spare_nodes)}/{len(s.failed_nodes)} "
        f"(active {', '.join(s.active_nodes) or '-'}; spare {', '.join(s.spare_nodes) or '-'}; "
        f"failed {', '.join(s.failed_nodes) or '-'})"
    )
    rows = [
        ("run", str(s.run)),
        ("phase", phase),
        ("step", str(s.step)),
        ("rate", rate),
        ("loss", "-" if s.loss is None else f"{s.loss:.4f}"),
        ("world size", f"{s.world_size} (generation {s.generation})"),
        ("nodes a/s/f", nodes),
        ("recoveries", str(s.recoveries)),
    ]
    if s.sync:
        rows.append(("outer loop", outer_loop_text(s.sync)))
    if s.stragglers:
        slow = sorted(s.stragglers.items())
        rows.append(("stragglers", ", ".join(f"{n} ({x:.2f}x its peers' step)" for n, x in slow)))
    if s.quarantined:
        rows.append(("quarantined", f"{', '.join(s.quarantined)} (`ringmaster release`)"))
    if s.last_recovery:
        rows.append(("last recovery", _last_recovery(s)))
    rows += [("last checkpoint", checkpoint_cell(s)), *_time_rows(s), ("message", s.message or "-")]
    for key, value in rows:
        out.add_row(key, escape(value))
    return out


def _time_rows(s: jobs.JobStatus) -> list[tuple[str, str]]:
    """Where the run's wall time went (:mod:`orchestrator.observe.training_time`).

    A restart-tier script reports no steps: its start-up runs on, so only the
    wall time is told.  A status from a controller that did not split the time
    gives its effective training alone.
    """
    split = s.training_time
    if split is None:
        text = f"{s.effective_fraction:.0%} ({s.productive_s:.1f}s of progress)"
        return [("effective training", text if s.train_started_at else "-")]
    if s.train_started_at is None:
        wait = "not reported by the script" if s.recovery == "restart" else "no step completed yet"
        return [
            ("effective training", f"- ({wait}; {seconds_text(split.wall_s)} since submission)")
        ]
    return time_rows(split)


def _last_recovery(s: jobs.JobStatus) -> str:
    """``agent_gone: 2.31s (detect 0.50s, rendezvous 0.80s, restore 0.60s, first step 0.41s)``."""
    last = s.last_recovery
    if not last:
        return "-"
    text = f"{last.get('cause', '?')}: {float(last.get('total_s', 0.0)):.2f}s"
    phases = last.get("phases")
    if isinstance(phases, dict) and phases and s.recovery == "restart":
        named = restart_phases(phases)
        text += " (" + ", ".join(f"{k} {v:.2f}s" for k, v in named.items())
        text += ")" if "to first output" in named else "; the script's progress not reported)"
    elif isinstance(phases, dict) and phases:
        timings = ordered_phases(phases).items()
        text += " (" + ", ".join(f"{phase_label(k)} {v:.2f}s" for k, v in timings) + ")"
    return text


def checkpoint_cell(s: jobs.JobStatus) -> str:
    """The last committed checkpoint, and a save still uploading (``step 60 uploading for 9 s``)."""
    if not s.last_checkpoint:
        text = "-"
    elif s.last_checkpoint_at is None:
        text = s.last_checkpoint
    else:
        ago = max(0.0, time.time() - s.last_checkpoint_at)
        text = f"{s.last_checkpoint}, {ago:.0f}s ago"
    if s.uploading is not None and not s.phase.terminal:
        step, since = s.uploading
        text += f"; step {step} uploading for {max(0.0, time.time() - since):.0f} s"
    return text


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
@click.argument("node")
@etcd_options
@handle_errors
def release(job: str, node: str, **kw: Any) -> None:
    """Let a node quarantined for being slow be a spare of JOB again."""
    with connect_client(kw) as client:
        status = jobs.read_status(client, job)
        if status is None:
            raise click.UsageError(f"no job named {job!r} (see `ringmaster status`)")
        if node not in status.quarantined:
            held = ", ".join(status.quarantined) or "none"
            raise click.UsageError(
                f"{node} is not quarantined in job {job!r} (quarantined: {held})"
            )
        jobs.send_command(client, job, "release", node=node)
    console.print(f"release of {node} requested for job '{job}'", highlight=False)


@click.command()
@click.argument("job")
@click.option("--node", help="only this node's workers")
@click.option("--tail", type=int, help="only the last N lines")
@click.option("--follow", "-f", is_flag=True, help="keep printing new lines (Ctrl-C to stop)")
@click.option("--timestamps", "-t", is_flag=True, help="prefix each line with its time")
@click.option(
    "--run",
    "run",
    type=int,
    help="only this run of the job (default: every run); with --follow, the run going on",
)
@etcd_options
@handle_errors
def logs(
    job: str,
    node: str | None,
    tail: int | None,
    follow: bool,
    timestamps: bool,
    run: int | None,
    **kw: Any,
) -> None:
    """Print the workers' output of a job, read from each node's agent.

    Each line starts with the worker that printed it, ``[node/local rank]``.
    A node whose agent is gone shows the last lines each of its workers
    printed before it exited (kept in etcd); its whole output is in the
    agent's stdout (the pod's log) and in the files under RINGMASTER_LOG_DIR
    on that host.  Without an etcd (after ``ringmaster run``, whose etcd ended
    with it) the files of this machine are read.
    """
    from orchestrator.observe.log_follow import follow_logs
    from orchestrator.observe.logs import LogLine, check_target, iter_logs
    from orchestrator.state.runs import list_runs, run_window

    def show(line: LogLine) -> None:
        stamp = (
            datetime.fromtimestamp(line.time).strftime("%H:%M:%S.%f")[:-3] + " "
            if timestamps
            else ""
        )
        click.echo(f"{stamp}[{line.worker}] {line.text}")

    def note(text: str) -> None:
        click.echo(f"note: {text}", err=True)

    if not kw.get("etcd_endpoints"):
        from orchestrator.observe.local_logs import iter_local_logs, local_job_dir

        if follow or run is not None:
            fail("no etcd given: pass --etcd host:port or set RINGMASTER_ETCD", 2)
        lines = iter_local_logs(job, node=node, tail=tail)
        first = next(lines, None)  # raises before the note when there is nothing here
        note(f"no etcd given: reading this machine's files in {local_job_dir(job)}")
        for line in [first] if first is not None else []:
            show(line)
        for line in lines:
            show(line)
        return
    with connect_client(kw) as client:
        check_target(client, job, node)
        since = 0.0
        if follow and run is not None:  # the run going on, from its start
            since = run_window(list_runs(client, job), run)[0]  # or: no such run
            current = jobs.read_spec_record(client, job).run
            status = jobs.read_status(client, job)
            if run != current or (status is not None and status.phase.terminal):
                fail(
                    f"--follow shows a run going on; run {run} has ended: drop --follow to read it",
                    2,
                )
        if not follow:
            for line in iter_logs(client, job, node=node, tail=tail, run=run, notes=note):
                show(line)
            return
        stop = threading.Event()
        try:
            lines = follow_logs(client, job, stop, node=node, tail=tail, notes=note, since=since)
            for line in lines:
                show(line)
        except KeyboardInterrupt:
            stop.set()
