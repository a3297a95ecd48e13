"""A worker that exited with an error, told once: in words and as a ``WorkerExited`` event.

Both node-side supervisors (the in-process tier's :mod:`agents.node.agent` and
the restart tier's :mod:`agents.node.restart_tier`) report a failed worker the same
way; the controller reads the event's ``error`` (see
:mod:`orchestrator.controller.world`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from agents.node.descriptions import describe_exit, read_error_file
from agents.node.log_shipper import LogShipper
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import events


def describe_failure(code: int, error_file: Path, shipper: LogShipper | None) -> str:
    """How the worker ended, with its error: torch's error file, else its last error line."""
    cause = read_error_file(error_file) or (shipper.last_error() if shipper else None)
    return describe_exit(code) + (f": {cause}" if cause else "")


def emit_worker_exited(
    client: EtcdClient, job: str, node: str, worker: str, code: int, what: str, **data: Any
) -> None:
    """Record the ``WorkerExited`` event (best effort: etcd may be away)."""
    with contextlib.suppress(Exception):
        events.emit(
            client,
            job,
            "WorkerExited",
            f"{worker} {what}",
            source=node,
            worker=worker,
            exit_code=code,
            error=what,
            **data,
        )
