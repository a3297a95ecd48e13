"""The node agent's port: its liveness status and watch, and the requests only its job may ask.

Runs in the node agent.  The port (:class:`~orchestrator.ports.liveness.LivenessServer`)
listens on the node's address.  Anyone who reaches it gets the status line
and may watch it (alive or dead, nothing more).  Every other request (the
workers' output, :mod:`agents.node.log_files`; the link sink and link probes,
:mod:`orchestrator.ports.link_probe`) must carry the job's port token, read from
etcd (:mod:`orchestrator.state.port_credential`), which the agent creates if its
job has none yet.  Link probes go only to the job's registered nodes, at their
registered ports, and carry the token to their sinks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.node import log_files
from orchestrator.etcd.client import EtcdClient
from orchestrator.ports.link_probe import PROBE_OP, SINK_OP, probe_peers, registered_ports, sink
from orchestrator.ports.liveness import LivenessServer
from orchestrator.state.port_credential import PortGuard, ensure_token

__all__ = ["open_port"]


def open_port(
    client: EtcdClient,
    job: str,
    node: str,
    address: str,
    status: Callable[[], dict[str, Any]],
    root: Path | None = None,
) -> LivenessServer:
    """Listen on ``address`` as ``node``'s agent in ``job`` (see the module docstring).

    Args:
        client: etcd: the job's port token (created if missing), its registrations.
        job / node: whose agent this is.
        address: the host to listen on (the port is chosen: see ``.address``).
        status: the liveness status line.
        root: where the workers' log files are (``RINGMASTER_LOG_DIR`` when None).

    Raises:
        EtcdError: the job's port token could not be read or created.
    """
    token = ensure_token(client, job)

    def probe(request: dict[str, Any]) -> dict[str, Any]:
        return probe_peers(request, lambda: registered_ports(client, job), token, job)

    return LivenessServer(
        address,
        status,
        {**log_files.requests(job, node, root), PROBE_OP: probe},
        streams={SINK_OP: sink},  # the controller measures links through it
        guard=PortGuard(job, token).refusal,
    )
