"""``ringmaster plan``: spares, checkpoint cadence and expected ETTR for a job, before it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from orchestrator.cli.options import Seconds, connect_client, etcd_options, fail, handle_errors


@click.command("plan")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option(
    "--nodes", type=click.IntRange(1, 200_000), help="nodes that train (default: nodes.max)"
)
@click.option(
    "--min-nodes",
    type=click.IntRange(1, 200_000),
    help="fewest nodes it trains on (default: nodes.min; a job file with min = max keeps one size)",
)
@click.option(
    "--gpus-per-node",
    type=click.IntRange(1, 64),
    help="GPUs per node (default: resources.gpus, else nproc_per_node)",
)
@click.option(
    "--failure-model",
    default="llama3",
    show_default=True,
    help="a preset (llama3, llama3-stragglers, none) or a YAML/JSON file (docs/planning.md)",
)
@click.option(
    "--from-run",
    "from_run",
    metavar="JOB",
    help="take the failure rate and recovery costs a job recorded in etcd (needs --etcd)",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="directory for plan.png and plan.html (default: plan-<job name>)",
)
@click.option("--step-time", type=Seconds(), default=2.0, show_default=True, help="seconds a step")
@click.option(
    "--state-gb",
    type=click.FloatRange(0.0, 100_000.0),
    default=10.0,
    show_default=True,
    help="GB of training state per node (what a heal or a checkpoint load moves)",
)
@click.option(
    "--replica-nodes",
    type=click.IntRange(1, 10_000),
    default=1,
    show_default=True,
    help="nodes of one model replica: the job shrinks by whole replicas",
)
@click.option(
    "--days", type=click.FloatRange(0.01, 365.0), default=30.0, show_default=True, help="simulated"
)
@click.option(
    "--seeds", type=click.IntRange(1, 20), default=3, show_default=True, help="runs averaged"
)
@click.option(
    "--repair-hours",
    type=click.FloatRange(0.0, 24 * 365.0),
    default=24.0,
    show_default=True,
    help="with --from-run: hours until a failed node is back (a job does not record it)",
)
@etcd_options
@handle_errors
def plan(
    job_file: str,
    nodes: int | None,
    min_nodes: int | None,
    gpus_per_node: int | None,
    failure_model: str,
    from_run: str | None,
    out: str | None,
    step_time: float,
    state_gb: float,
    replica_nodes: int,
    days: float,
    seeds: int,
    repair_hours: float,
    **kw: Any,
) -> None:
    """Recommend warm spares and a checkpoint cadence for JOB_FILE, and the ETTR to expect.

    Simulates the job through DAYS of failures under torchrun, torchft and
    ringmaster's two tiers; writes ETTR against spares and against cadence as a
    PNG and an HTML page. The rule: spares maximise ETTR x N / (N + spares);
    cadence starts from Young/Daly, sqrt(2 x C x MTBF).
    """
    from orchestrator.planning.costs import Measured, recovery_model
    from orchestrator.planning.from_run import (
        failure_model_from_run,
        measured_from_run,
        read_run,
    )
    from orchestrator.planning.plan import job_shape, make_plan, tier_of
    from orchestrator.planning.presets import failure_model as named_model
    from orchestrator.planning.report import plan_lines, write_report
    from orchestrator.spec.loader import load_job_file

    if not Path(job_file).is_file():
        fail(f"{job_file}: no such job file (give the YAML file the job runs from)", 2)
    spec = load_job_file(job_file)
    if replica_nodes > (nodes or spec.nodes.max):
        fail(
            f"--replica-nodes {replica_nodes} is more than the job's {nodes or spec.nodes.max} "
            "nodes: give at most the job's node count",
            2,
        )
    shape = job_shape(
        spec,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        step_s=step_time,
        state_gb=state_gb,
        replica_nodes=replica_nodes,
        min_nodes=min_nodes,
    )
    measured = Measured()
    failures = None
    if from_run:
        with connect_client(kw) as client:
            figures = read_run(client, from_run)
        measured = measured_from_run(figures, state_gb, measured)
        click.echo(
            f"from job {from_run}: {sum(figures.failures.values())} failed nodes in "
            f"{figures.node_days:.3f} node-days, {figures.recoveries} recoveries"
            + (
                " (median " + ", ".join(f"{k} {v:.2f}s" for k, v in figures.phases.items()) + ")"
                if figures.phases
                else ""
            )
        )
        given = click.get_current_context().get_parameter_source("failure_model")
        if figures.failures or given is not click.core.ParameterSource.COMMANDLINE:
            failures = failure_model_from_run(figures, repair_hours * 3600.0)
    if failures is None:
        failures = named_model(failure_model)
    result = make_plan(
        shape, failures, recovery_model(shape, measured), tier_of(spec), days * 86400.0, seeds
    )
    for line in plan_lines(result):
        click.echo(line)
    png, page = write_report(result, Path(out or f"plan-{spec.name}"))
    click.echo(f"\nwrote {png} and {page}")
