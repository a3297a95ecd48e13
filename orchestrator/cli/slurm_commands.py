"""``ringmaster slurm``: a job in a Slurm allocation (script, submit; run and agent inside it)."""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import click

from orchestrator.cli.options import (
    Seconds,
    build_etcd_options,
    console,
    etcd_options,
    fail,
    handle_errors,
    print_table,
)
from orchestrator.settings import SETTINGS


@click.group()
def slurm() -> None:
    """Run a job in a Slurm allocation: etcd and the controller on the batch host, one
    agent per node, warm spares among the allocation's nodes (docs/slurm.md)."""


def _script_options(fn: Any) -> Any:
    options = [
        click.option("--partition", "-p", help="Slurm partition  [job file: slurm.partition]"),
        click.option("--account", "-A", help="Slurm account  [slurm.account]"),
        click.option("--qos", help="Slurm quality of service  [slurm.qos]"),
        click.option("--time", "-t", "time_limit", help="time limit, e.g. 4:00:00  [slurm.time]"),
        click.option("--gpus-per-node", type=click.IntRange(min=0), help="[slurm.gpus_per_node]"),
        click.option(
            "--extra",
            multiple=True,
            metavar="OPTION",
            help="one more #SBATCH option, e.g. --constraint=a100 (repeat)  [slurm.extra]",
        ),
        click.option(
            "--module", "modules", multiple=True, help="module to load (repeat)  [slurm.modules]"
        ),
        click.option(
            "--setup", multiple=True, metavar="LINE", help="shell line run first  [slurm.setup]"
        ),
        click.option(
            "--requeue/--no-requeue",
            default=None,
            help="back to the queue when the allocation ends first  [slurm.requeue]",
        ),
        click.option(
            "--signal-grace",
            type=Seconds(maximum=65535),
            help="seconds before the time limit to write the final checkpoint  "
            "[slurm.signal_grace]",
        ),
        click.option(
            "--exclusive/--shared", default=None, help="whole nodes or not  [slurm.exclusive]"
        ),
        click.option(
            "--output",
            "-o",
            help="the script's output file (sbatch patterns: %x job name, %j job id)  "
            "[default: ringmaster-%x-%j.out]",
        ),
        click.option(
            "--etcd",
            "etcd_endpoints",
            help="etcd endpoints host:port,... to use instead of an etcd on the batch host",
        ),
        click.option(
            "--python",
            "python",
            default=sys.executable,
            show_default=True,
            help="the Python with ringmaster on the nodes (a shared venv)",
        ),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _render(job_file: str, kw: dict[str, Any]) -> tuple[str, str]:
    """The batch script of ``job_file`` with the command line's overrides; and its job name."""
    from orchestrator.slurm.script import DEFAULT_OUTPUT, batch_script, with_overrides
    from orchestrator.spec.entrypoint import check_entrypoint, resolve_recovery
    from orchestrator.spec.loader import load_job_file

    spec = load_job_file(job_file)
    check_entrypoint(spec, os.getcwd(), job_file)
    spec, _ = resolve_recovery(spec, os.getcwd(), job_file)
    grace = kw["signal_grace"]
    spec = with_overrides(
        spec,
        partition=kw["partition"],
        account=kw["account"],
        qos=kw["qos"],
        time=kw["time_limit"],
        gpus_per_node=kw["gpus_per_node"],
        extra=kw["extra"],
        modules=kw["modules"],
        setup=kw["setup"],
        requeue=kw["requeue"],
        signal_grace=None if grace is None else timedelta(seconds=grace),
        exclusive=kw["exclusive"],
    )
    endpoints = [e for e in (kw["etcd_endpoints"] or "").split(",") if e.strip()]
    script = batch_script(
        spec,
        str(Path(job_file).resolve()),
        workdir=os.getcwd(),
        ringmaster=[kw["python"], "-m", "orchestrator.cli"],
        etcd=endpoints,
        output=kw["output"] or DEFAULT_OUTPUT,
    )
    return script, spec.name


@slurm.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@_script_options
@handle_errors
def script(job_file: str, **kw: Any) -> None:
    """Print the batch script of JOB_FILE (submit it with sbatch, or edit it first)."""
    text, _ = _render(job_file, kw)
    click.echo(text, nl=False)


@slurm.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@_script_options
@handle_errors
def submit(job_file: str, **kw: Any) -> None:
    """Submit JOB_FILE to Slurm with sbatch; print the Slurm job id."""
    from orchestrator.slurm.commands import submit_script

    text, name = _render(job_file, kw)
    job_id = submit_script(text)
    output = (kw["output"] or "ringmaster-%x-%j.out").replace("%x", name).replace("%j", job_id)
    console.print(
        f"submitted job '{name}' as Slurm job {job_id}; its output: {output}",
        highlight=False,
        soft_wrap=True,
        markup=False,
    )


@slurm.command("run")
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@etcd_options
@handle_errors
def run_cmd(job_file: str, **kw: Any) -> None:
    """Run JOB_FILE in this Slurm allocation (what the batch script runs).

    Starts etcd here (unless --etcd or the job file's rendezvous.endpoints give
    one), the controller, and one agent per node with srun; ends with the job's
    exit status.  SIGUSR1 (sbatch --signal=B:USR1@grace): final checkpoint, then
    requeue (slurm.requeue); SIGTERM: final checkpoint, end.
    """
    from orchestrator.cli.local_commands import run_table
    from orchestrator.slurm.allocation import run_in_allocation
    from orchestrator.slurm.api import Allocation
    from orchestrator.spec.entrypoint import check_entrypoint, resolve_recovery
    from orchestrator.spec.loader import load_job_file

    spec = load_job_file(job_file)
    check_entrypoint(spec, os.getcwd(), job_file)
    spec, _ = resolve_recovery(spec, os.getcwd(), job_file)
    allocation = Allocation.from_environ()
    etcd = build_etcd_options(kw, job=spec.rendezvous)
    result = run_in_allocation(spec, allocation, etcd=etcd)
    print_table(run_table(spec.name, result.run))
    sys.exit(result.exit_code)


@slurm.command()
@click.option("--job", required=True, envvar="RINGMASTER_JOB", help="job to serve")
@click.option(
    "--wait-for-job",
    type=click.FloatRange(min=0),
    default=SETTINGS.job_wait.total_seconds(),
    metavar="SECONDS",
    help="how long to wait for the job (0: forever; default: RINGMASTER_JOB_WAIT)",
)
@etcd_options
@handle_errors
def agent(job: str, wait_for_job: float, **kw: Any) -> None:
    """Run this Slurm node's agent (what each task of the agents' srun step runs).

    The node's name and labels come from Slurm; a drained node leaves as on a
    preemption (SIGTERM): the job saves and a spare takes its slot.
    """
    import logging

    from agents.node.agent import JobNotSubmittedError, NodeRefusedError
    from orchestrator.etcd.client import connect
    from orchestrator.slurm.node_agent import slurm_node_agent

    level = logging.getLevelName(SETTINGS.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(message)s")
    if level <= logging.WARNING:
        logging.getLogger("ringmaster.agent").setLevel(min(level, logging.INFO))
    options = build_etcd_options(kw)
    if options is None:
        fail("no etcd given: pass --etcd host:port or set RINGMASTER_ETCD", 2)
        return
    with connect(options) as client:
        node_agent, watch = slurm_node_agent(client, options, job)
        signal.signal(signal.SIGTERM, lambda *_: node_agent.preempt())
        signal.signal(signal.SIGINT, lambda *_: node_agent.request_stop())
        watch.start()
        try:
            code = node_agent.run(timedelta(seconds=wait_for_job))
        except (JobNotSubmittedError, NodeRefusedError) as e:
            fail(str(e), 2)
            return
        finally:
            watch.stop()
    sys.exit(code)
