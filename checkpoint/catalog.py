"""URL-level operations for people and the CLI: list, latest, verify, gc.

``ringmaster checkpoints list|verify|gc URL`` call these and print the
result; they run in one process and need no process group.  A URL is either
a checkpoint root (``s3://bucket/run``) or one checkpoint directory under it
(``s3://bucket/run/step-0000000100-1a2b3c4d``).
"""

from __future__ import annotations

from typing import Any

from checkpoint.api import CheckpointInfo, CheckpointNotFoundError, VerifyReport
from checkpoint.commit import latest_committed, list_checkpoints, parse_step_dir, verify_checkpoint
from checkpoint.fsspec_storage import Location
from checkpoint.retention import RetentionResult, apply_retention


def _split(url: str, storage_options: dict[str, Any] | None) -> tuple[Location, str | None]:
    """(root, checkpoint name or None) for a root URL or a checkpoint directory URL."""
    trimmed = url.rstrip("/")
    parent, _, name = trimmed.rpartition("/")
    if parse_step_dir(name) is not None:
        return Location.from_url(parent, storage_options), name
    return Location.from_url(trimmed, storage_options), None


def checkpoints(url: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Every checkpoint under a root, committed or not, oldest first."""
    root, _ = _split(url, storage_options)
    return list_checkpoints(root)


def latest(url: str, storage_options: dict[str, Any] | None = None) -> CheckpointInfo | None:
    """The newest committed checkpoint under a root."""
    root, _ = _split(url, storage_options)
    return latest_committed(root)


def verify(url: str, storage_options: dict[str, Any] | None = None) -> VerifyReport:
    """Verify one checkpoint directory, or the newest committed one under a root.

    Raises:
        CheckpointNotFoundError: a root without any committed checkpoint.
        CheckpointCorruptError: the directory has no valid manifest.
    """
    root, name = _split(url, storage_options)
    if name is None:
        newest = latest_committed(root)
        if newest is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {root.url}")
        name = newest.name
    return verify_checkpoint(root.child(name))


def gc(
    url: str,
    keep: int,
    storage_options: dict[str, Any] | None = None,
    *,
    all_uncommitted: bool = False,
) -> RetentionResult:
    """Apply retention under a root (``all_uncommitted`` only when no save is running)."""
    root, _ = _split(url, storage_options)
    return apply_retention(root, keep, all_uncommitted=all_uncommitted)
