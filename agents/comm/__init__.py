"""Gradient communication for DDP: topology-aware, hierarchical and compressed comm hooks.

The worker runtime calls :func:`build_comm_hook` with the job's ``comm``
section and registers the result on its DDP model; see
:class:`~agents.comm.api.CommHook` for the whole surface.
"""

from __future__ import annotations

from agents.comm.api import (
    CommConfigError,
    CommError,
    CommHook,
    CommMetrics,
    HookStateError,
    NodeLayout,
    StepMetrics,
)
from agents.comm.factory import build_comm_hook

__all__ = [
    "CommConfigError",
    "CommError",
    "CommHook",
    "CommMetrics",
    "HookStateError",
    "NodeLayout",
    "StepMetrics",
    "build_comm_hook",
]
