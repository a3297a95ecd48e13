"""Asynchronous sharded checkpoints with a commit protocol and elastic resume.

The public surface is re-exported here; contracts live in :mod:`checkpoint.api`.
"""

from __future__ import annotations

from checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointInfo,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointPeerError,
    CheckpointStorageError,
    CheckpointTimeoutError,
    Manifest,
    ObjectEntry,
    PermanentCheckpointError,
    RestoreResult,
    RestoreSource,
    RetryableCheckpointError,
    SaveHandle,
    SaveInProgressError,
    SaveStatus,
    TrainState,
    VerifyReport,
)
from checkpoint.checkpointer import Checkpointer
from checkpoint.data_position import ElasticSampler
from checkpoint.manifest import job_spec_hash
from checkpoint.triggers import SaveTrigger, request_on_signal

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointPeerError",
    "CheckpointStorageError",
    "CheckpointTimeoutError",
    "Checkpointer",
    "ElasticSampler",
    "Manifest",
    "ObjectEntry",
    "PermanentCheckpointError",
    "RestoreResult",
    "RestoreSource",
    "RetryableCheckpointError",
    "SaveHandle",
    "SaveInProgressError",
    "SaveStatus",
    "SaveTrigger",
    "TrainState",
    "VerifyReport",
    "job_spec_hash",
    "request_on_signal",
]
