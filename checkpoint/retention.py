"""Retention: keep the newest N committed checkpoints, remove the rest and dead saves.

Runs after a new checkpoint is committed, never before, so the newest
committed checkpoint is never deleted.  An older committed checkpoint loses
its manifest first (from that moment it no longer counts) and then its
objects, so a deletion interrupted half-way never leaves something that looks
committed.  Directories that never committed are removed once a committed
checkpoint of a later or equal step exists: such a save can no longer be in
flight, because a job has one save in flight at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from checkpoint.api import MANIFEST_NAME, CheckpointInfo, CheckpointStorageError
from checkpoint.commit import list_checkpoints
from checkpoint.fsspec_storage import Location

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionResult:
    """What retention removed and kept.

    Attributes:
        kept: names of committed checkpoints kept, newest first.
        deleted: names of committed checkpoints deleted.
        cleaned: names of never-committed directories removed.
    """

    kept: tuple[str, ...]
    deleted: tuple[str, ...]
    cleaned: tuple[str, ...]


def _remove(root: Location, info: CheckpointInfo) -> None:
    directory = root.child(info.name)
    if info.committed:
        directory.fs.rm_file(directory.path(MANIFEST_NAME))
    directory.fs.rm(directory.root, recursive=True)


def apply_retention(root: Location, keep: int, *, all_uncommitted: bool = False) -> RetentionResult:
    """Delete committed checkpoints beyond the newest ``keep`` and dead directories.

    Args:
        root: the checkpoint root.
        keep: how many committed checkpoints to keep (at least 1).
        all_uncommitted: also remove never-committed directories newer than
            the newest committed checkpoint, or all of them when nothing is
            committed (``gc``, when no save is running).

    Raises:
        ValueError: ``keep`` is below 1.
        CheckpointStorageError: listing or deleting failed.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    infos = list_checkpoints(root)
    committed = [i for i in reversed(infos) if i.committed]
    if not committed and not all_uncommitted:
        return RetentionResult(kept=(), deleted=(), cleaned=())
    newest_step = committed[0].step if committed else -1
    kept, old = committed[:keep], committed[keep:]
    dead = [i for i in infos if not i.committed and (all_uncommitted or i.step <= newest_step)]
    deleted, cleaned = [], []
    try:
        for info in old:
            _remove(root, info)
            deleted.append(info.name)
        for info in dead:
            _remove(root, info)
            cleaned.append(info.name)
    except OSError as e:
        raise CheckpointStorageError(f"retention under {root.url} failed: {e}") from e
    if deleted or cleaned:
        log.info(
            "retention under %s: kept %s, deleted %s, removed uncommitted %s",
            root.url,
            [i.name for i in kept],
            deleted,
            cleaned,
        )
    return RetentionResult(
        kept=tuple(i.name for i in kept), deleted=tuple(deleted), cleaned=tuple(cleaned)
    )
