"""Long-running services: the node agent, the controller, the operator."""

from __future__ import annotations

import signal
import sys
from datetime import timedelta
from typing import Any

import click

from orchestrator.cli.options import (
    build_etcd_options,
    connect_client,
    etcd_options,
    fail,
    handle_errors,
)
from orchestrator.etcd.client import connect
from orchestrator.settings import SETTINGS


@click.command()
@click.option("--job", required=True, envvar="RINGMASTER_JOB", help="job to serve")
@click.option("--node", required=True, envvar="RINGMASTER_NODE", help="this node's name")
@click.option("--labels", envvar="RINGMASTER_LABELS", help="topology labels: zone=a,rack=r1")
@click.option("--address", default="127.0.0.1", envvar="RINGMASTER_ADDRESS", show_default=True)
@click.option(
    "--wait-for-job",
    type=click.FloatRange(min=0),
    default=SETTINGS.job_wait.total_seconds(),
    metavar="SECONDS",
    help="how long to wait for the job to be submitted (or for its next run), then exit "
    "with code 2 "
    "(0: forever; default: RINGMASTER_JOB_WAIT, 0)",
)
@etcd_options
@handle_errors
def agent(
    job: str, node: str, labels: str | None, address: str, wait_for_job: float, **kw: Any
) -> None:
    """Run the node agent: wait for the job, register, start workers, supervise.

    SIGTERM is a preemption (save, then leave); before the job is submitted it
    just ends the agent.
    """
    import logging

    from agents.node.agent import JobNotSubmittedError, NodeAgent, NodeRefusedError
    from agents.node.descriptions import parse_labels

    level = logging.getLevelName(SETTINGS.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(message)s")
    # the agent's own lifecycle lines (INFO) show unless the level asks for errors only
    if level <= logging.WARNING:
        logging.getLogger("ringmaster.agent").setLevel(min(level, logging.INFO))
    try:
        parsed = parse_labels(labels)
    except ValueError as e:
        fail(f"--labels: {e}", 2)
        return
    options = build_etcd_options(kw)
    if options is None:
        fail("no etcd given: pass --etcd host:port or set RINGMASTER_ETCD", 2)
        return
    with connect(options) as client:
        node_agent = NodeAgent(client, options, job, node, parsed, address)
        signal.signal(signal.SIGTERM, lambda *_: node_agent.preempt())
        signal.signal(signal.SIGINT, lambda *_: node_agent.request_stop())
        try:
            code = node_agent.run(timedelta(seconds=wait_for_job))
        except (JobNotSubmittedError, NodeRefusedError) as e:
            fail(str(e), 2)
            return
    sys.exit(code)


@click.command()
@click.option("--job", envvar="RINGMASTER_JOB", help="serve only this job (default: all)")
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    envvar="RINGMASTER_METRICS_PORT",
    help="serve Prometheus metrics on this port while leading (0: any free port; "
    "the URL is written to etcd at /ringmaster/controller/metrics)",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    envvar="RINGMASTER_METRICS_HOST",
    help="address the metrics endpoint listens on (0.0.0.0: every interface)",
)
@etcd_options
@handle_errors
def controller(job: str | None, metrics_port: int | None, metrics_host: str, **kw: Any) -> None:
    """Run a controller; the first one leads, the others stand by."""
    import logging
    import threading

    from orchestrator.controller.service import Controller

    logging.basicConfig(
        level=logging.getLevelName(SETTINGS.log_level), format="%(asctime)s %(message)s"
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with connect_client(kw) as client:
        Controller(client, job, metrics_port, metrics_host).run(stop)


@click.command()
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
