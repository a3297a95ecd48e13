"""``ringmaster operator``: start kopf with the TrainingJob handlers.

The operator runs as one replica (``standalone``: no kopf peering objects are
needed; the Deployment uses the Recreate strategy so two never overlap).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import kopf

from orchestrator.etcd.options import EtcdOptions
from orchestrator.operator import handlers
from orchestrator.operator.api import OperatorSettings
from orchestrator.operator.handlers import Runtime
from orchestrator.operator.kube import KubeClient
from orchestrator.operator.records import EtcdJobRecords


def build_runtime(settings: OperatorSettings | None = None) -> Runtime:
    """The runtime of a real operator: cluster credentials and the configured etcd."""
    settings = settings or OperatorSettings.from_env()
    return Runtime(
        kube=KubeClient.from_environment(),
        records=EtcdJobRecords(etcd_base_options(settings)),
        settings=settings,
    )


def etcd_base_options(settings: OperatorSettings) -> EtcdOptions:
    """The operator's own TLS files and credentials, used for every etcd it talks to."""
    return EtcdOptions(
        endpoints=settings.etcd_endpoints,
        ca_cert=settings.etcd_ca,
        cert=settings.etcd_cert,
        key=settings.etcd_key,
        user=settings.etcd_user,
        password=settings.etcd_password,
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
