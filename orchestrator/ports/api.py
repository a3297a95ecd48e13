"""Contracts of the agents' ports as their clients see them: a refused request, no answer.

The port itself is :mod:`orchestrator.ports.liveness` (served by each node agent,
asked by the controller and the CLI); :mod:`orchestrator.ports.link_probe` measures
the links between nodes through it.  Pure.
"""

from __future__ import annotations

from orchestrator.api import OrchestratorError

__all__ = ["AgentUnreachableError", "RequestError"]


class RequestError(OrchestratorError):
    """A request to an agent's port that cannot be answered (the message says why)."""


class AgentUnreachableError(OrchestratorError):
    """No answer from an agent's port: it is gone, cut off, or serves no requests."""
