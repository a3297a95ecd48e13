"""Verification markers: what is known of a checkpoint's objects, kept beside its manifest.

Reading every object back is the only way to know a checkpoint is sound, and
it costs as much as the checkpoint is large; so its outcome is written down
once, as a small object in the checkpoint's directory:
:data:`~checkpoint.api.VERIFIED_MARKER` when every object matched the
manifest, :data:`~checkpoint.api.FAILED_MARKER` (with the problems found)
when one was missing or did not match.  A failed checkpoint is marked, not
deleted: restore and retention pass it over (:attr:`CheckpointInfo.usable
<checkpoint.api.CheckpointInfo.usable>`), and a person can still look at it.
Listing learns the markers from the directory listing it makes anyway, so
knowing them reads nothing more.

Markers are written by whoever verified: the coordinator of a restore, the
retention pass of the coordinator's saver, ``ringmaster checkpoints
verify|list --verify``.  Runs in any of those processes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Sequence

from checkpoint.api import (
    FAILED_MARKER,
    VERIFIED_MARKER,
    CheckpointStorageError,
    Verification,
)
from checkpoint.fsspec_storage import Location

__all__ = ["failure_note", "mark_failed", "mark_verified", "record", "verification_of"]

log = logging.getLogger(__name__)


def verification_of(names: Collection[str]) -> Verification:
    """What the markers among a checkpoint directory's object ``names`` say.

    A failed marker wins over a verified one (a checkpoint verified once can
    rot later; the newer finding is the failure).
    """
    if FAILED_MARKER in names:
        return Verification.FAILED
    if VERIFIED_MARKER in names:
        return Verification.VERIFIED
    return Verification.NOT_VERIFIED


def _write(directory: Location, name: str, body: dict[str, object], drop: str) -> None:
    try:
        directory.fs.pipe_file(directory.path(name), json.dumps(body, indent=1).encode())
        if directory.fs.exists(directory.path(drop)):
            directory.fs.rm_file(directory.path(drop))
    except OSError as e:
        raise CheckpointStorageError(
            f"could not record the verification of {directory.url} ({name}): {e}"
        ) from e


def mark_verified(directory: Location) -> None:
    """Record that every object of ``directory`` matched its manifest just now.

    Raises:
        CheckpointStorageError: the marker could not be written.
    """
    _write(directory, VERIFIED_MARKER, {"verified_at": time.time()}, drop=FAILED_MARKER)


def mark_failed(directory: Location, problems: Sequence[str]) -> None:
    """Record that ``directory`` failed verification, and why.

    Raises:
        CheckpointStorageError: the marker could not be written.
    """
    body: dict[str, object] = {"failed_at": time.time(), "problems": list(problems)}
    _write(directory, FAILED_MARKER, body, drop=VERIFIED_MARKER)
    log.warning(
        "checkpoint %s failed verification and is marked (%s): %s",
        directory.url,
        FAILED_MARKER,
        "; ".join(problems),
    )


def record(directory: Location, problems: Sequence[str]) -> bool:
    """Mark ``directory`` verified (no ``problems``) or failed; False when that failed.

    For callers that verified on their way to something else (a restore,
    retention): not being able to write the marker is logged, never raised.
    """
    try:
        if problems:
            mark_failed(directory, problems)
        else:
            mark_verified(directory)
    except CheckpointStorageError as e:
        log.warning("%s", e)
        return False
    return True


def failure_note(directory: Location) -> str | None:
    """The problems a failed marker recorded, as one line (None without a readable one)."""
    try:
        raw = json.loads(directory.fs.cat_file(directory.path(FAILED_MARKER)))
    except (OSError, ValueError):
        return None
    problems = raw.get("problems") if isinstance(raw, dict) else None
    if not isinstance(problems, list):
        return None
    return "; ".join(str(p) for p in problems)
