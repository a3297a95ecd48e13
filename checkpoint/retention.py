"""Retention: keep the newest N sound checkpoints of a run, remove the rest and dead saves.

Runs in the process that saves (the coordinator's saver, after each commit)
or in ``ringmaster checkpoints gc``.  It runs after a new checkpoint is
committed, never before, so the newest committed checkpoint is never deleted.

A run touches only its own lineage: the checkpoints whose directory token
carries its run's tag (:func:`checkpoint.commit.lineage_tag`), committed or
not.  Another run writing to the same root, and its save in progress, are
never its business; nor are checkpoints saved without a run id by a saver
that has one (``gc`` without ``--run`` applies the rule to each lineage on
its own).  A directory of its own lineage that never committed is removed once
one of its committed checkpoints is of a later or equal step: such a save can
no longer be in flight, because a run has one save in flight at a time.

Nothing valid is deleted to keep something unknown: before a committed
checkpoint beyond the newest ``keep`` goes, every checkpoint kept in its
place is read back and checked against its manifest, once in its life (the
outcome is marked beside it, :mod:`checkpoint.verification`).  A checkpoint
that fails is marked, not deleted, and not counted: the next older one is
kept instead.  A failed checkpoint is removed only once it is older than the
oldest one kept, when it would have gone anyway.  The cost is one read of
each checkpoint by the coordinator, the first time retention relies on it.

An older committed checkpoint loses its manifest first (from that moment it
no longer counts) and then its objects, so a deletion interrupted half-way
never leaves something that looks committed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from checkpoint.api import (
    MANIFEST_NAME,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointStorageError,
    Verification,
)
from checkpoint.commit import lineage_of, lineage_tag, list_checkpoints, verify_checkpoint
from checkpoint.fsspec_storage import Location
from checkpoint.verification import record

__all__ = ["RetentionResult", "apply_retention"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionResult:
    """What retention removed, kept and found corrupt.

    Attributes:
        kept: names of committed checkpoints kept, newest first.
        deleted: names of committed checkpoints deleted.
        cleaned: names of never-committed directories removed.
        failed: names of checkpoints that failed verification in this pass
            (marked and left in place, not counted as kept).
    """

    kept: tuple[str, ...]
    deleted: tuple[str, ...]
    cleaned: tuple[str, ...]
    failed: tuple[str, ...] = ()


@dataclass
class _Plan:
    kept: list[CheckpointInfo]
    deleted: list[CheckpointInfo]
    cleaned: list[CheckpointInfo]
    failed: list[CheckpointInfo]


def _remove(root: Location, info: CheckpointInfo) -> None:
    directory = root.child(info.name)
    if info.committed:
        try:
            directory.fs.rm_file(directory.path(MANIFEST_NAME))
        except FileNotFoundError:
            pass  # removed meanwhile (by ``gc``): what is left goes below
    directory.fs.rm(directory.root, recursive=True)


def _sound(root: Location, info: CheckpointInfo) -> bool:
    """Read ``info`` back and mark what was found; False when it is corrupt.

    Raises:
        CheckpointStorageError: reading failed (nothing is marked: not a finding).
    """
    directory = root.child(info.name)
    try:
        problems = list(verify_checkpoint(directory).problems)
    except CheckpointCorruptError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            return False  # its manifest went meanwhile: nothing to mark
        problems = [str(e)]
    record(directory, problems)
    return not problems


def _plan(
    root: Location, lineage: list[CheckpointInfo], keep: int, all_uncommitted: bool, verify: bool
) -> _Plan:
    """What to do with one lineage's directories (oldest first)."""
    committed = [i for i in reversed(lineage) if i.committed]  # newest first
    candidates = [i for i in committed if i.verification is not Verification.FAILED]
    must_check = verify and len(candidates) > keep  # only when something valid would go
    kept: list[CheckpointInfo] = []
    failed: list[CheckpointInfo] = []
    visited = 0
    for info in candidates:
        if len(kept) == keep:
            break
        visited += 1
        if must_check and info.verification is Verification.NOT_VERIFIED and not _sound(root, info):
            failed.append(info)
            continue
        kept.append(info)
    deleted = candidates[visited:]
    if kept:
        oldest_kept = kept[-1]
        marked = [i for i in committed if i.verification is Verification.FAILED]
        deleted += [i for i in marked + failed if i.step < oldest_kept.step]
    newest_step = committed[0].step if committed else -1
    if not committed and not all_uncommitted:
        cleaned: list[CheckpointInfo] = []
    else:
        cleaned = [
            i for i in lineage if not i.committed and (all_uncommitted or i.step <= newest_step)
        ]
    return _Plan(kept=kept, deleted=deleted, cleaned=cleaned, failed=failed)


def apply_retention(
    root: Location,
    keep: int,
    *,
    run_id: str | None = None,
    all_uncommitted: bool = False,
    verify: bool = True,
) -> RetentionResult:
    """Delete committed checkpoints beyond the newest ``keep`` sound ones, and dead directories.

    Args:
        root: the checkpoint root.
        keep: how many committed checkpoints to keep per lineage (at least 1).
        run_id: only this run's lineage ("": saves made without a run id);
            None: every lineage under the root, each kept on its own.
        all_uncommitted: also remove never-committed directories newer than
            the newest committed checkpoint of their lineage, or all of them
            when it has none (``gc``, when no save is running).
        verify: read back the checkpoints kept in place of one deleted, if
            not verified yet (off only where a caller checks otherwise).

    Raises:
        ValueError: ``keep`` is below 1.
        CheckpointStorageError: listing, reading or deleting failed.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    want = lineage_tag(run_id) if run_id is not None else None
    lineages: dict[str | None, list[CheckpointInfo]] = {}
    for info in list_checkpoints(root):
        tag = lineage_of(info.name)
        if run_id is None or tag == want:
            lineages.setdefault(tag, []).append(info)
    kept, deleted, cleaned, failed = [], [], [], []
    try:
        for lineage in lineages.values():
            plan = _plan(root, lineage, keep, all_uncommitted, verify)
            kept += plan.kept
            failed += [i.name for i in plan.failed]
            for info in plan.deleted:
                _remove(root, info)
                deleted.append(info.name)
            for info in plan.cleaned:
                _remove(root, info)
                cleaned.append(info.name)
    except OSError as e:
        raise CheckpointStorageError(f"retention under {root.url} failed: {e}") from e
    kept.sort(key=lambda i: (i.step, i.manifest.created_at if i.manifest else 0.0), reverse=True)
    if deleted or cleaned or failed:
        log.info(
            "retention under %s: kept %s, deleted %s, removed uncommitted %s, failed %s",
            root.url,
            [i.name for i in kept],
            deleted,
            cleaned,
            failed,
        )
    return RetentionResult(
        kept=tuple(i.name for i in kept),
        deleted=tuple(deleted),
        cleaned=tuple(cleaned),
        failed=tuple(failed),
    )
