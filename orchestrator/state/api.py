"""Contracts of what is kept in etcd: the errors of its records, its jobs and its fences.

The keyspace is :mod:`orchestrator.state.keys`, the records
:mod:`orchestrator.state.records` (written and read by :mod:`orchestrator.state.codec`),
the job calls behind the CLI :mod:`orchestrator.state.jobs`.  Pure.
"""

from __future__ import annotations

from orchestrator.api import OrchestratorError

__all__ = [
    "CheckpointStorageRefusedError",
    "FencedError",
    "JobExistsError",
    "PortCredentialError",
    "RecordError",
    "ResumeRefusedError",
]


class RecordError(OrchestratorError):
    """A stored value is missing, is not JSON, or does not match its record type."""


class FencedError(OrchestratorError):
    """This process no longer belongs to the job's current generation."""


class JobExistsError(OrchestratorError):
    """A job of that name is already submitted (and not finished)."""


class ResumeRefusedError(OrchestratorError):
    """A resume cannot start: the job is still active, or the checkpoint is unusable."""


class CheckpointStorageRefusedError(OrchestratorError):
    """``checkpoint.url`` cannot be written: a run would train with nothing durable."""


class PortCredentialError(OrchestratorError):
    """The job's port credential cannot be read from etcd (the message says why)."""
