"""The ``ringmaster`` command line.

Thin by design: each command parses its options, calls one library function
and prints the result.  Options fall back to ``RINGMASTER_*`` environment
variables (``--etcd`` ← ``RINGMASTER_ETCD`` ...).  Exit codes: 0 success,
1 runtime failure, 2 bad input (invalid job file, bad option).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from orchestrator import jobs
from orchestrator.api import OrchestratorError, SpecError
from orchestrator.etcd_client import EtcdClient, EtcdOptions, connect, parse_endpoints

console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def etcd_options(fn: F) -> F:
    """Add the shared etcd connection options to a command."""
    options = [
        click.option(
            "--etcd",
            "etcd_endpoints",
            envvar="RINGMASTER_ETCD",
            help="etcd client endpoints, host:port[,host:port...]  [env RINGMASTER_ETCD]",
        ),
        click.option("--etcd-ca", envvar="RINGMASTER_ETCD_CA", help="CA certificate (TLS)"),
        click.option("--etcd-cert", envvar="RINGMASTER_ETCD_CERT", help="client certificate"),
        click.option("--etcd-key", envvar="RINGMASTER_ETCD_KEY", help="client key"),
        click.option("--etcd-user", envvar="RINGMASTER_ETCD_USER", help="etcd user"),
        click.option(
            "--etcd-password",
            envvar="RINGMASTER_ETCD_PASSWORD",
            help="etcd password (prefer the env variable)",
        ),
        click.option(
            "--etcd-timeout",
            type=float,
            default=5.0,
            show_default=True,
            envvar="RINGMASTER_ETCD_CONNECT_TIMEOUT",
            help="seconds to wait for etcd to answer",
        ),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def build_etcd_options(kw: dict[str, Any], default: str | None = None) -> EtcdOptions | None:
    """EtcdOptions from the shared CLI options; None when no endpoint is given."""
    text = kw.pop("etcd_endpoints", None) or default
    ca, cert, key = kw.pop("etcd_ca", None), kw.pop("etcd_cert", None), kw.pop("etcd_key", None)
    user, password = kw.pop("etcd_user", None), kw.pop("etcd_password", None)
    timeout = kw.pop("etcd_timeout", 5.0)
    if not text:
        return None
    return EtcdOptions(
        endpoints=parse_endpoints(text),
        ca_cert=ca,
        cert=cert,
        key=key,
        user=user,
        password=password,
        connect_timeout=timedelta(seconds=timeout),
    )


def _connect(kw: dict[str, Any]) -> EtcdClient:
    options = build_etcd_options(kw)
    if options is None:
        _fail("no etcd given: pass --etcd host:port or set RINGMASTER_ETCD", 2)
        raise AssertionError("unreachable")
    return connect(options)


def handle_errors(fn: F) -> F:
    """Turn library errors into one clear line and an exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SpecError as e:
            click.echo(str(e), err=True)
            sys.exit(2)
        except OrchestratorError as e:
            _fail(str(e))

    return wrapper  # type: ignore[return-value]


@click.group()
@click.version_option(package_name="ringmaster")
def main() -> None:
    """ringmaster: fault-tolerant, elastic training for PyTorch."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
def validate(job_file: str) -> None:
    """Check a job file; print OK or every problem (exit 2)."""
    from orchestrator.spec_loader import load_job_file

    try:
        spec = load_job_file(job_file)
    except SpecError as e:
        click.echo(str(e), err=True)
        sys.exit(2)
    except OSError as e:
        _fail(f"cannot read {job_file}: {e.strerror}", 2)
        return
    console.print(f"OK: job '{spec.name}' ({job_file})", highlight=False)


@main.command("etcd")
@click.option("--port", type=int, default=2379, show_default=True, help="client port")
@click.option("--data-dir", type=click.Path(file_okay=False), help="keep data here")
def etcd_cmd(port: int, data_dir: str | None) -> None:
    """Run a local etcd in the foreground (development)."""
    from orchestrator.embedded_etcd import EmbeddedEtcd

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


@main.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@etcd_options
@handle_errors
def submit(job_file: str, **kw: Any) -> None:
    """Submit a job to the cluster's controller through etcd."""
    from orchestrator.spec_loader import load_job_file

    spec = load_job_file(job_file)
    with _connect(kw) as client:
        jobs.submit(client, spec)
    console.print(f"submitted job '{spec.name}'", highlight=False)


@main.command()
@click.argument("job", required=False)
@etcd_options
@handle_errors
def status(job: str | None, **kw: Any) -> None:
    """Show one job, or all jobs, as a table."""
    with _connect(kw) as client:
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


@main.command()
@click.argument("job")
@etcd_options
@handle_errors
def stop(job: str, **kw: Any) -> None:
    """Ask the controller to stop a job (after a final checkpoint)."""
    with _connect(kw) as client:
        jobs.request_stop(client, job)
    console.print(f"stop requested for job '{job}'", highlight=False)


@main.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--kill-node-at-step",
    type=int,
    help="SIGKILL one active node (agent and workers) at this step, to show recovery",
)
@click.option("--timeout", type=float, default=1800, show_default=True, help="seconds")
@etcd_options
@handle_errors
def run(job_file: str, kill_node_at_step: int | None, timeout: float, **kw: Any) -> None:
    """Run a job on this machine: etcd (embedded unless --etcd), controller, agents."""
    from orchestrator.local_run import run_job
    from orchestrator.spec_loader import load_job_file

    spec = load_job_file(job_file)
    result = run_job(
        spec,
        etcd=build_etcd_options(kw),
        kill_node_at_step=kill_node_at_step,
        timeout=timedelta(seconds=timeout),
    )
    table = Table("job", "phase", "steps", "recoveries", "node killed", "wall time")
    table.add_row(
        spec.name,
        result.phase.value,
        str(result.step),
        str(result.recoveries),
        f"{result.killed_node} at step {result.killed_at_step}" if result.killed_node else "-",
        f"{result.wall_s:.1f}s",
    )
    console.print(table)
    if result.phase.value != "Succeeded":
        sys.exit(1)


@main.command()
@click.option("--job", required=True, envvar="RINGMASTER_JOB", help="job to serve")
@click.option("--node", required=True, envvar="RINGMASTER_NODE", help="this node's name")
@click.option("--labels", envvar="RINGMASTER_LABELS", help="topology labels: zone=a,rack=r1")
@click.option("--address", default="127.0.0.1", envvar="RINGMASTER_ADDRESS", show_default=True)
@etcd_options
@handle_errors
def agent(job: str, node: str, labels: str | None, address: str, **kw: Any) -> None:
    """Run the node agent: register, start workers, supervise (SIGTERM = preemption)."""
    import logging

    from agents.node_agent import NodeAgent, parse_labels

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    try:
        parsed = parse_labels(labels)
    except ValueError as e:
        _fail(f"--labels: {e}", 2)
        return
    options = build_etcd_options(kw)
    if options is None:
        _fail("no etcd given: pass --etcd host:port or set RINGMASTER_ETCD", 2)
        return
    with connect(options) as client:
        node_agent = NodeAgent(client, options, job, node, parsed, address)
        signal.signal(signal.SIGTERM, lambda *_: node_agent.preempt())
        signal.signal(signal.SIGINT, lambda *_: node_agent.request_stop())
        code = node_agent.run()
    sys.exit(code)


@main.command()
@click.option("--job", envvar="RINGMASTER_JOB", help="serve only this job (default: all)")
@etcd_options
@handle_errors
def controller(job: str | None, **kw: Any) -> None:
    """Run a controller; the first one leads, the others stand by."""
    import logging
    import threading

    from orchestrator.controller import Controller

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with _connect(kw) as client:
        Controller(client, job).run(stop)


@main.command()
@click.option(
    "--namespace",
    "-n",
    "namespaces",
    multiple=True,
    envvar="RINGMASTER_NAMESPACES",
    help="namespace to watch (repeat for several; default: all)",
)
def operator(namespaces: tuple[str, ...]) -> None:
    """Run the Kubernetes operator for TrainingJobs (needs the `operator` extra)."""
    from orchestrator.operator import run_operator

    run_operator(namespaces)


if __name__ == "__main__":  # pragma: no cover
    main()
