"""The record of a job's newest committed durable checkpoint (key ``checkpoint``).

Written by rank 0 at each commit, read by the controller (its events) and the
CLI; re-exported by :mod:`orchestrator.state.records` with the other records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.state.codec import Record

__all__ = ["CHECKPOINT_RECORD_KEEPS", "CheckpointRecord", "CommittedCheckpoint"]


@dataclass
class CommittedCheckpoint(Record):
    """One earlier commit, as :class:`CheckpointRecord` keeps the last few."""

    step: int
    reason: str
    at: float


#: Earlier commits a checkpoint record keeps: what a controller that was away (none
#: led the job for a while) turns into the events it missed.
CHECKPOINT_RECORD_KEEPS = 16


@dataclass
class CheckpointRecord(Record):
    """The newest committed durable checkpoint, written by rank 0 (fenced).

    ``earlier`` holds the commits before it, oldest first (at most
    :data:`CHECKPOINT_RECORD_KEEPS`): the record is one key that every commit
    replaces, and the controller writes each commit's event from it, so one
    that took over after a time without a leader finds the commits it missed.
    """

    url: str
    step: int
    reason: str
    at: float
    earlier: list[CommittedCheckpoint] = field(default_factory=list)

    def after(self, previous: CheckpointRecord | None) -> CheckpointRecord:
        """This commit as it replaces ``previous``: the earlier commits carried over."""
        if previous is None or previous.at >= self.at:
            return self
        last = CommittedCheckpoint(previous.step, previous.reason, previous.at)
        kept = [*previous.earlier, last][-CHECKPOINT_RECORD_KEEPS:]
        return CheckpointRecord(self.url, self.step, self.reason, self.at, kept)

    def unseen(self, seen_at: float | None) -> list[CheckpointRecord]:
        """The commits after the one last seen (committed at ``seen_at``; None: none was
        seen), oldest first, each as a record of its own: the earlier ones, then this one."""
        missed = [
            CheckpointRecord(self.url, c.step, c.reason, c.at)
            for c in self.earlier
            if seen_at is None or c.at > seen_at
        ]
        return [*missed, self]
