"""The job's record of its newest checkpoint commit, written by rank 0 (fenced).

Runs in the training process (:mod:`agents.runtime.saving` writes it after
each commit).  The controller turns the record into ``CheckpointSaved``
events and ``status``'s last checkpoint.
"""

from __future__ import annotations

import logging

from orchestrator.api import EtcdError
from orchestrator.state import keys, records
from orchestrator.state.api import RecordError
from orchestrator.state.fencing import GenerationFence
from orchestrator.state.records import CheckpointRecord

__all__ = ["record_commit"]

log = logging.getLogger("ringmaster.worker")


def record_commit(fence: GenerationFence, job: str, record: CheckpointRecord) -> None:
    """Write ``record`` as the job's newest commit (fenced), keeping the commits before it.

    The record is one key each commit replaces; it carries the earlier commits
    (:meth:`~orchestrator.state.records.CheckpointRecord.after`), so a controller that
    was away when they were made writes their events when it is back.

    Raises:
        FencedError: the generation moved on.
        EtcdError: etcd could not be reached.
    """
    key = keys.job_checkpoint(job)
    try:
        previous = records.read(fence.client, key, CheckpointRecord)
    except (EtcdError, RecordError) as e:
        log.warning("the earlier checkpoint record is not carried over: %s", e)
        previous = None
    fence.put(key, record.after(previous).encode())
