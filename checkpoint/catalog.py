"""URL-level operations for people and the CLI: list, latest, verify, gc.

``ringmaster checkpoints list|verify|gc URL`` call these and print the
result; they run in one process and need no process group.  A URL is either
a checkpoint root (``s3://bucket/run``) or one checkpoint directory under it
(``s3://bucket/run/step-0000000100-1a2b3c4d``), with one of the protocols in
:data:`~checkpoint.api.CHECKPOINT_PROTOCOLS`; any other is refused before
anything is contacted.  Verifying records its outcome beside the manifest
(:mod:`checkpoint.verification`).
"""

from __future__ import annotations

import re
from typing import Any

from checkpoint.api import (
    CHECKPOINT_PROTOCOLS,
    CheckpointCorruptError,
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
    read_manifest,
    verify_checkpoint,
)
from checkpoint.fsspec_storage import Location
from checkpoint.retention import RetentionResult, apply_retention
from checkpoint.verification import failure_note, mark_failed, mark_verified

__all__ = [
    "check_protocol",
    "check_spec_hash",
    "checkpoints",
    "failure_reason",
    "gc",
    "latest",
    "open_root",
    "redact",
    "resume_point",
    "scrub",
    "verify",
    "verify_all",
]

_USERINFO_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")
_SECRET_PAIR_RE = re.compile(r"[^\s/@'\"():]+:[^\s/@'\"]+@")


def redact(url: str) -> str:
    """``url`` without any ``user:secret@`` part, for messages and logs."""
    return _USERINFO_RE.sub(r"\1***@", url)


def scrub(text: str) -> str:
    """``text`` with every ``user:secret@`` pair masked (errors quote URLs and buckets)."""
    return _SECRET_PAIR_RE.sub("***@", text)


def check_protocol(url: str) -> None:
    """Refuse a URL whose protocol checkpoints cannot use, before contacting anything.

    Raises:
        CheckpointStorageError: naming the URL and the protocols that work.
    """
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in CHECKPOINT_PROTOCOLS:
        usable = ", ".join(f"{p}://" for p in CHECKPOINT_PROTOCOLS)
        raise CheckpointStorageError(
            f"{redact(url)}: protocol {protocol!r} cannot hold checkpoints; "
            f"use a local path or one of {usable}"
        )


def _location(url: str, storage_options: dict[str, Any] | None) -> Location:
    try:
        return Location.from_url(url, storage_options)
    except CheckpointStorageError as e:
        raise CheckpointStorageError(scrub(str(e).replace(url, redact(url)))) from e
    except Exception as e:  # a filesystem that connects when made (resolving a host...)
        raise CheckpointStorageError(
            scrub(f"checkpoint storage {redact(url)} is not reachable ({type(e).__name__}: {e})")
        ) from e


def _split(url: str, storage_options: dict[str, Any] | None) -> tuple[Location, str | None]:
    """(root, checkpoint name or None) for a root URL or a checkpoint directory URL."""
    check_protocol(url)
    trimmed = url.rstrip("/")
    parent, _, name = trimmed.rpartition("/")
    if parse_step_dir(name) is not None:
        return _location(parent, storage_options), name
    return _location(trimmed, storage_options), None


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
        if root.fs.isfile(root.root):
            raise CheckpointStorageError(
                f"{redact(root.url)} is a file, not a checkpoint root: give the directory "
                "(or prefix) that holds the step-<n>-<token> checkpoint directories"
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
        if not info.usable:
            raise CheckpointNotFoundError(
                f"{redact(info.url)} failed verification ({failure_reason(root, name)}); "
                f"`ringmaster checkpoints verify {redact(info.url)}` checks it again"
            )
        return info
    newest = latest_committed(root)
    if newest is None:
        raise CheckpointNotFoundError(
            f"no committed checkpoint that passed verification under {redact(root.url)}"
            if any(i.committed for i in list_checkpoints(root))
            else f"no committed checkpoint under {redact(root.url)}"
        )
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


def failure_reason(root: Location, name: str) -> str:
    """Why a checkpoint marked as failed failed, as its marker recorded it."""
    return scrub(failure_note(root.child(name)) or "the reason was not recorded")


def _verify_and_mark(directory: Location) -> VerifyReport:
    """Verify a committed checkpoint and record the outcome beside it.

    Raises:
        CheckpointCorruptError: no valid manifest to verify against.
        CheckpointStorageError: objects or the marker could not be read or written.
    """
    report = verify_checkpoint(directory)
    if report.ok:
        mark_verified(directory)
    else:
        mark_failed(directory, report.problems)
    return report


def verify(url: str, storage_options: dict[str, Any] | None = None) -> VerifyReport:
    """Verify one checkpoint directory, or the newest committed one under a root.

    The outcome is recorded beside the manifest: a directory that verifies
    again after it had failed becomes a candidate for restore again.

    Raises:
        CheckpointNotFoundError: a root without any committed checkpoint.
        CheckpointCorruptError: the directory has no valid manifest.
        CheckpointStorageError: reading, or recording the outcome, failed.
    """
    root, name = _split(url, storage_options)
    if name is None:
        newest = latest_committed(root)
        if newest is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {redact(root.url)}")
        name = newest.name
    else:
        _check_named(root, name)
    return _verify_and_mark(root.child(name))


def _check_named(root: Location, name: str) -> None:
    """A checkpoint directory named on the command line exists and holds the step its
    name says (one copied or renamed to another step is no checkpoint of that step).

    Raises:
        CheckpointNotFoundError: there is no such directory.
        CheckpointCorruptError: its manifest is of another step.
    """
    directory = root.child(name)
    try:
        if not root.fs.isdir(directory.path()):
            raise CheckpointNotFoundError(f"{redact(directory.url)} does not exist")
        manifest = read_manifest(directory)
    except FileNotFoundError:
        return  # no manifest: verifying says so
    except OSError as e:
        raise CheckpointStorageError(_describe_unreachable(root, e)) from e
    step = parse_step_dir(name)
    if manifest.step != step:
        raise CheckpointCorruptError(
            f"{redact(directory.url)} is named step {step} but its manifest is of step "
            f"{manifest.step} (copied or renamed?): it is no checkpoint of step {step}"
        )


def verify_all(root: Location) -> list[CheckpointInfo]:
    """Verify every committed checkpoint under ``root`` (reads all of them), then list
    (a directory that cannot be read listed with the error, as ``list`` does).

    Raises:
        CheckpointStorageError: reading, or recording an outcome, failed.
    """
    for info in list_checkpoints(root, list_unreadable=True):
        if info.committed:
            try:
                _verify_and_mark(root.child(info.name))
            except CheckpointCorruptError:
                pass  # its manifest went meanwhile: the listing below says so
    return list_checkpoints(root, list_unreadable=True)


def gc(
    url: str,
    keep: int,
    storage_options: dict[str, Any] | None = None,
    *,
    all_uncommitted: bool = False,
    run_id: str | None = None,
) -> RetentionResult:
    """Apply retention under a root (``all_uncommitted`` only when no save is running).

    Each lineage (the checkpoints of one run) keeps its own newest ``keep``;
    ``run_id`` limits it to that run's.

    Raises:
        CheckpointNotFoundError: ``url`` is a checkpoint directory, not a root
            (retention would apply to the root around it, that directory included).
    """
    root, name = _split(url, storage_options)
    if name is not None:
        raise CheckpointNotFoundError(
            f"{redact(url)} is a checkpoint directory; gc applies retention to a checkpoint "
            f"root, every checkpoint in it: give the root ({redact(root.url)}) to mean that"
        )
    return apply_retention(root, keep, run_id=run_id, all_uncommitted=all_uncommitted)
