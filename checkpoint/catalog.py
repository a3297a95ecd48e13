"""URL-level operations for people and the CLI: list, latest, verify, gc.

``ringmaster checkpoints list|verify|gc URL`` call these and print the
result; they run in one process and need no process group.  A URL is either
a checkpoint root (``s3://bucket/run``) or one checkpoint directory under it
(``s3://bucket/run/step-0000000100-1a2b3c4d``).
"""

from __future__ import annotations

import re
from typing import Any

from checkpoint.api import (
    CheckpointInfo,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    VerifyReport,
)
from checkpoint.commit import (
    inspect_checkpoint,
    latest_committed,
    list_checkpoints,
    parse_step_dir,
    verify_checkpoint,
)
from checkpoint.fsspec_storage import Location
from checkpoint.retention import RetentionResult, apply_retention

_USERINFO_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")
_SECRET_PAIR_RE = re.compile(r"[^\s/@'\"():]+:[^\s/@'\"]+@")


def redact(url: str) -> str:
    """``url`` without any ``user:secret@`` part, for messages and logs."""
    return _USERINFO_RE.sub(r"\1***@", url)


def scrub(text: str) -> str:
    """``text`` with every ``user:secret@`` pair masked (errors quote URLs and buckets)."""
    return _SECRET_PAIR_RE.sub("***@", text)


def _split(url: str, storage_options: dict[str, Any] | None) -> tuple[Location, str | None]:
    """(root, checkpoint name or None) for a root URL or a checkpoint directory URL."""
    trimmed = url.rstrip("/")
    parent, _, name = trimmed.rpartition("/")
    if parse_step_dir(name) is not None:
        return Location.from_url(parent, storage_options), name
    return Location.from_url(trimmed, storage_options), None


def _describe_unreachable(root: Location, error: BaseException) -> str:
    kind = type(error).__name__
    if isinstance(error, PermissionError):
        hint = "access denied: check the credentials (environment, ~/.aws, storage options)"
    else:
        hint = "check the URL, the bucket or directory, the endpoint and the credentials"
    return scrub(
        f"checkpoint storage {redact(root.url)} is not reachable ({kind}: {error}); {hint}"
    )


def open_root(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[Location, str | None]:
    """Resolve ``url`` and prove it can be listed; (root, checkpoint name or None).

    Raises:
        CheckpointStorageError: the URL cannot be opened, the bucket (or top
            directory) does not exist, or listing is refused.  Credentials
            never appear in the message.
    """
    root, name = _split(url, storage_options)
    try:
        root.refresh()
        if not root.fs.exists(root.root):
            top = root.root.split("/", 1)[0]
            # On object stores an empty prefix does not "exist"; its bucket must.
            if root.is_local or not top or not root.fs.exists(top):
                raise FileNotFoundError(
                    f"{top or root.root} does not exist"
                    + ("" if root.is_local else " or these credentials may not see it")
                )
    except CheckpointStorageError:
        raise
    except Exception as e:  # botocore and aiohttp errors are not all OSErrors
        raise CheckpointStorageError(_describe_unreachable(root, e)) from e
    return root, name


def resume_point(url: str, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """The committed checkpoint a resume from ``url`` would load.

    ``url`` is a checkpoint directory (that one, which must be committed) or a
    root (its newest committed checkpoint).  Objects are not read back here;
    the workers verify checksums before loading.

    Raises:
        CheckpointStorageError: the storage is unreachable (see :func:`open_root`).
        CheckpointNotFoundError: nothing committed there.
    """
    root, name = open_root(url, storage_options)
    if name is not None:
        try:
            info = inspect_checkpoint(root, name)
        except OSError as e:
            raise CheckpointStorageError(_describe_unreachable(root, e)) from e
        if not info.committed:
            raise CheckpointNotFoundError(
                f"{redact(info.url)} is not a committed checkpoint: {info.problem}"
            )
        return info
    newest = latest_committed(root)
    if newest is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {redact(root.url)}")
    return newest


def check_spec_hash(info: CheckpointInfo, expected: str, *, force: bool = False) -> None:
    """Refuse to resume from a checkpoint saved by a job whose state-shaping spec differs.

    An empty hash on either side (a checkpoint saved outside a job) passes.

    Raises:
        CheckpointMismatchError: the hashes differ and ``force`` is not set.
    """
    recorded = info.manifest.job_spec_hash if info.manifest else ""
    if force or not recorded or not expected or recorded == expected:
        return
    raise CheckpointMismatchError(
        f"{redact(info.url)} was saved by a job with a different entrypoint, arguments or "
        f"gradient compression (spec hash {recorded}, this job {expected}); its state may not "
        "fit this job. Pass --force to resume from it anyway"
    )


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
