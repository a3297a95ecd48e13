"""``ringmaster operator``: start kopf with the TrainingJob handlers.

The operator runs as one replica (``standalone``: no kopf peering objects are
needed; the Deployment uses the Recreate strategy so two never overlap).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import kopf

from orchestrator.operator import handlers
from orchestrator.operator.api import OperatorSettings
from orchestrator.operator.handlers import Runtime
from orchestrator.operator.kube import KubeClient
from orchestrator.operator.records import EtcdJobRecords


def build_runtime(settings: OperatorSettings | None = None) -> Runtime:
    """The runtime of a real operator: cluster credentials and the configured etcd."""
    return Runtime(
        kube=KubeClient.from_environment(),
        records=EtcdJobRecords(),
        settings=settings or OperatorSettings.from_env(),
    )


def run_operator(
    namespaces: Sequence[str] = (),
    *,
    liveness_port: int | None = 8080,
    settings: OperatorSettings | None = None,
) -> None:
    """Run the operator until it is stopped (SIGTERM / Ctrl-C).

    Args:
        namespaces: namespaces to watch; empty means the whole cluster.
        liveness_port: serve kopf's ``/healthz`` on this port (None: off).
        settings: operator settings; default: from the environment.
    """
    assert handlers.on_spec is not None  # importing the module registers the handlers
    runtime = build_runtime(settings)
    endpoint = f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None
    asyncio.run(
        kopf.operator(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            liveness_endpoint=endpoint,
            memo=kopf.Memo(runtime=runtime),
        )
    )
