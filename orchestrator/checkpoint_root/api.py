"""Contracts of a checkpoint root: the error of a root that cannot be taken.

Who writes a root is decided in :mod:`orchestrator.checkpoint_root.writer_marker`
(pure) and held by :mod:`orchestrator.checkpoint_root.writer_hold`; what a
restart-tier script keeps in it is read by
:mod:`orchestrator.checkpoint_root.script_checkpoint` and
:mod:`orchestrator.checkpoint_root.reach`.  Pure.
"""

from __future__ import annotations

from orchestrator.api import OrchestratorError

__all__ = ["RootHeldError"]


class RootHeldError(OrchestratorError):
    """The checkpoint root cannot be taken: a live run writes it, or the store refused."""
