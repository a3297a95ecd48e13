"""A small real job and real etcd servers with TLS or auth, shared by the security tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from orchestrator.etcd.embedded import EmbeddedEtcd, EtcdUser, ServerTLS
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from tests.certs import TLSFiles

REPO = Path(__file__).resolve().parents[2]


def one_node_job(
    name: str, tmp: Path, steps: int = 12, checkpoint: dict[str, Any] | None = None
) -> JobSpec:
    """One node, one worker running examples/train_tiny.py for ``steps`` steps."""
    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(REPO / "examples" / "train_tiny.py"),
                "args": ["--out", str(tmp / "final.pt")],
                "env": {"RINGMASTER_LOG_EVERY": "4"},
            },
            "nodes": {"min": 1, "max": 1, "spares": 0},
            "max_steps": steps,
            "checkpoint": checkpoint or {"url": f"file://{tmp}/ckpt", "every_steps": 0},
            "fault_tolerance": {"hang_timeout": "60s", "heartbeat_interval": "500ms"},
        }
    )


@contextmanager
def tls_etcd(files: TLSFiles) -> Iterator[EmbeddedEtcd]:
    """An etcd that serves TLS only and requires client certificates."""
    tls = ServerTLS(
        files.server_cert,
        files.server_key,
        files.ca,
        client_cert_auth=True,
        admin_cert=files.client_cert,
        admin_key=files.client_key,
    )
    with EmbeddedEtcd(tls=tls) as server:
        yield server


@contextmanager
def auth_etcd(root_password: str, user: EtcdUser) -> Iterator[EmbeddedEtcd]:
    """A plain-text etcd with auth on: ``root`` and ``user`` limited to its prefix."""
    with EmbeddedEtcd() as server:
        server.enable_auth(root_password, [user])
        yield server


def ringmaster(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real ``ringmaster`` CLI in a child process."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_ETCD")}
    child_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
