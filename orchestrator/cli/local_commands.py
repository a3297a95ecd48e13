"""Commands that work on this machine: check a job file, run etcd, run a job."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import (
    build_etcd_options,
    column,
    console,
    etcd_options,
    fail,
    handle_errors,
    print_table,
    table,
)
from orchestrator.observe.training_time import PART_LABELS, PARTS, seconds_text, time_parts
from orchestrator.spec.api import SpecError

if TYPE_CHECKING:
    from orchestrator.local_run import RunResult
    from orchestrator.state.records import TrainingTime

#: What the restart tier shows where the script would have to report (steps, progress).
NOT_REPORTED = "not reported by the script"


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
def validate(job_file: str) -> None:
    """Check a job file and that its entrypoint is here; print OK or every problem (exit 2).

    Also prints how the job recovers (``fault_tolerance.recovery`` resolved by
    reading the entrypoint) and why, and, in the restart tier, where the script
    keeps its own checkpoint (or that it cannot tell) with a warning when a node
    whose agent starts elsewhere would not find it.
    """
    from orchestrator.checkpoint_root.reach import script_checkpoint
    from orchestrator.spec.entrypoint import check_entrypoint, resolve_recovery
    from orchestrator.spec.job import RecoveryMode
    from orchestrator.spec.loader import load_job_file

    try:
        spec = load_job_file(job_file)
        check_entrypoint(spec, os.getcwd(), job_file)
        spec, recovery = resolve_recovery(spec, os.getcwd(), job_file)
    except SpecError as e:
        click.echo(str(e), err=True)
        sys.exit(2)
    except OSError as e:
        fail(f"cannot read {job_file}: {e.strerror}", 2)
        return
    console.print(f"OK: job '{spec.name}' ({job_file})", highlight=False)
    console.print(recovery, highlight=False, soft_wrap=True)
    if spec.fault_tolerance.recovery is RecoveryMode.RESTART:
        found = script_checkpoint(spec, os.getcwd())
        lines = [f"checkpoint: {found.where}"] + (
            [f"warning: {found.warning}"] * bool(found.warning)
        )
        for line in lines:
            console.print(line, highlight=False, soft_wrap=True, markup=False)


@click.command("etcd")
@click.option("--port", type=int, default=2379, show_default=True, help="client port")
@click.option("--data-dir", type=click.Path(file_okay=False), help="keep data here")
def etcd_cmd(port: int, data_dir: str | None) -> None:
    """Run a local etcd in the foreground (development)."""
    from orchestrator.etcd.embedded import EmbeddedEtcd

    server = EmbeddedEtcd(data_dir=data_dir, client_port=port)
    with server:
        console.print(f"etcd listening on {server.endpoint} (Ctrl-C to stop)")
        stop = {"flag": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
        try:
            while not stop["flag"] and server.proc is not None and server.proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass


@click.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--kill-node-at-step",
    type=int,
    help="SIGKILL one active node (agent and workers) at this step, to show recovery",
)
@click.option("--timeout", type=float, default=1800, show_default=True, help="seconds")
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    default=0,
    show_default=True,
    help="the controller's Prometheus port (0: any free port; the URL is printed)",
)
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False),
    help="when the job ends, write its HTML report here (and the PNG beside it)",
)
@click.option(
    "--from",
    "from_url",
    help="start from this checkpoint directory, or the newest committed one under this root",
)
@click.option(
    "--resume",
    "resume_own",
    is_flag=True,
    help="resume from the newest committed checkpoint under the job's checkpoint.url; "
    "fail before starting if there is none",
)
@click.option(
    "--force",
    is_flag=True,
    help="with --from/--resume: accept a checkpoint of a differently set-up job",
)
@click.option(
    "--label",
    "labels",
    multiple=True,
    metavar="NODE:KEY=VALUE",
    help="a label of one of the run's nodes (node-0, node-1, ...), e.g. node-1:zone=b to "
    "put it in another site (sync.mode diloco); repeat for more",
)
@etcd_options
@handle_errors
def run(
    job_file: str,
    kill_node_at_step: int | None,
    timeout: float,
    metrics_port: int,
    report_path: str | None,
    from_url: str | None,
    resume_own: bool,
    force: bool,
    labels: tuple[str, ...],
    **kw: Any,
) -> None:
    """Run a job on this machine: etcd (embedded unless --etcd or the job file's
    rendezvous.endpoints give one), controller, agents.

    One live run writes a checkpoint.url: while another run holds it (its
    heartbeat in the root is fresh), this one is refused before anything
    starts, with that run's name.  Without --from or --resume the job
    continues from the newest committed checkpoint under its checkpoint.url
    when there is one (a killed run's, whose stale hold is taken over with a
    warning), and starts fresh otherwise; --from URL starts it from another
    run's checkpoint.
    """
    from orchestrator.checkpoint_root.writer_hold import refuse_if_held, root_url
    from orchestrator.local_run import LocalRun, local_node_names, node_labels_from
    from orchestrator.observe.live_view import LiveView
    from orchestrator.observe.report import write_report
    from orchestrator.spec.entrypoint import check_entrypoint, resolve_recovery
    from orchestrator.spec.loader import load_job_file
    from orchestrator.state.jobs import plan_resume

    spec = load_job_file(job_file)
    check_entrypoint(spec, os.getcwd(), job_file)
    spec, _ = resolve_recovery(spec, os.getcwd(), job_file)
    resume = None
    try:
        node_labels = node_labels_from(labels, local_node_names(spec))
    except ValueError as e:
        fail(str(e), 2)
    if from_url and resume_own:
        fail("give either --from URL or --resume (the job's own checkpoints), not both", 2)
    # Before anything starts: no other live run writes the root (the controller then
    # takes it before the job's first plan, which settles two runs that start at once).
    refuse_if_held(root_url(spec.checkpoint.url, os.getcwd()))
    if from_url or resume_own:
        from orchestrator.cli.checkpoint_commands import print_resume

        # Checked before anything starts: reachable, committed, from a job like this one.
        resume = plan_resume(spec, from_url, force=force)
        print_resume(spec.name, resume, spec.nodes.max * spec.nproc_per_node)
    elif force:
        fail("--force only applies with --from or --resume", 2)
    with (
        LiveView(console, spec.name, spec.max_steps) as view,
        LocalRun(
            spec,
            etcd=build_etcd_options(kw, job=spec.rendezvous),
            kill_node_at_step=kill_node_at_step,
            timeout=timedelta(seconds=timeout),
            metrics_port=metrics_port,
            view=view,
            resume=resume,
            node_labels=node_labels,
        ) as local,
    ):
        received = _interrupt_on_sigterm()
        try:
            result = local.wait()
        except KeyboardInterrupt:  # SIGINT, or SIGTERM (a scheduler, `timeout`, systemd)
            result = local.interrupt()
        if report_path:
            html_out, png_out, _ = write_report(local.client, spec.name, report_path)
            view.print(f"[run] report: {html_out} and {png_out}")
    print_table(run_table(spec.name, result))
    if result.recovery != "restart" and result.training_time is not None:
        print_table(time_table(result.training_time))
    if local.etcd_embedded:
        from orchestrator.observe.local_logs import local_job_dir

        console.print(
            f"the run's etcd ended with it: `ringmaster logs {spec.name}` reads the workers' "
            f"output from {local_job_dir(spec.name)} on this machine",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
    if received:  # the shell's convention for a process ended by a signal
        sys.exit(128 + received[-1])
    if result.phase.value != "Succeeded":
        sys.exit(1)


def _interrupt_on_sigterm() -> list[int]:
    """Make SIGTERM end a run as Ctrl-C does (a final save, then a clean stop).

    Returns:
        The signals received since (SIGINT or SIGTERM), filled in as they come.
    """
    received: list[int] = []

    def interrupt(signum: int, _frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    return received


def run_table(job: str, result: RunResult) -> Table:
    """How a local run ended, as one row that wraps (never cuts) to fit the output.

    A restart-tier script reports no steps: its steps and effective training
    read "not reported by the script" rather than 0.  The failed nodes are the
    ones the controller declared failed (killed by ``--kill-node-at-step`` or
    from outside).
    """
    restart = result.recovery == "restart"
    out = table(
        column("job"),
        column("phase", wrap=False),
        column("steps"),
        column("recoveries", wrap=False, justify="right"),
        column("nodes failed"),
        column("wall time", wrap=False, justify="right"),
        column("effective"),
    )
    if result.killed_node:
        failed = f"{result.killed_node} (killed at step {result.killed_at_step})"
        failed = ", ".join([failed, *(n for n in result.failed_nodes if n != result.killed_node)])
    else:
        failed = ", ".join(result.failed_nodes) or "-"
    out.add_row(
        escape(job),
        result.phase.value,
        NOT_REPORTED if restart else str(result.step),
        str(result.recoveries),
        escape(failed),
        f"{result.wall_s:.1f}s",
        NOT_REPORTED if restart else f"{result.effective_fraction:.0%}",
    )
    return out


def time_table(split: TrainingTime) -> Table:
    """Where a run's wall time went, as one row under the run's table: start-up,
    productive, lost to failures, checkpoint stalls, the rest, and the effective
    training since the first step beside the whole run's
    (:mod:`orchestrator.observe.training_time`)."""
    out = table(
        *(column(PART_LABELS[part], justify="right") for part in PARTS),
        column("effective", wrap=False, justify="right"),
        column("whole run", justify="right"),
        title="where the wall time went (effective training: since the first step)",
    )
    out.add_row(
        *(seconds_text(v) for v in time_parts(split).values()),
        f"{split.effective:.1%}",
        f"{split.whole_run:.1%}",
    )
    return out
