"""The Kubernetes operator for ``TrainingJob`` resources (``ringmaster operator``).

Layout: :mod:`.api` (names, settings, plans, errors), :mod:`.crd` (the CRD,
generated from the job spec), :mod:`.meta`, :mod:`.pods` and :mod:`.children`
(child objects as dicts), :mod:`.status` (controller record → CR status),
:mod:`.reconcile` (the pure reconcile function), :mod:`.topology` (Node labels
→ pod annotations → the agent), :mod:`.records` (etcd), :mod:`.kube` (the only
module importing the Kubernetes client), :mod:`.handlers` (kopf) and
:mod:`.runner`.  Importing this package imports neither kopf nor the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def run_operator(namespaces: Sequence[str] = (), **kwargs: Any) -> None:
    """Run the operator (see :func:`orchestrator.operator.runner.run_operator`)."""
    from orchestrator.operator.runner import run_operator as run

    run(namespaces, **kwargs)


__all__ = ["run_operator"]
