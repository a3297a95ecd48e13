"""The commit protocol on object stores: step directories, manifests, discovery, verify.

Object stores have no atomic rename of a directory, so a checkpoint is never
moved into place.  Each save writes a fresh directory
``<root>/step-<step>-<token>/``; when every rank's objects are written, one
rank writes ``manifest.json`` listing each object with its size and checksum.
A checkpoint exists only when its manifest exists, parses, and every object
it lists is present with the listed size.  ``latest`` is found by listing
those directories; there is no pointer object that could run ahead of data.

``verify`` reads objects back and compares checksums; it can be split across
ranks (each checks every ``world``-th object).  What it found is kept beside
the manifest (:mod:`checkpoint.verification`); a checkpoint that failed is
listed but is no candidate for ``latest``.

A directory's token says whose it is before any manifest exists: a saver
with a run id starts each token with :func:`lineage_tag` of it (the manifest
then records the run id in full), so retention can tell its own saves,
finished or not, from those of another run writing to the same root.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Sequence

from checkpoint.api import (
    CHECKSUM_ALGORITHM,
    MANIFEST_NAME,
    STEP_DIR_PREFIX,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointStorageError,
    CommitFence,
    Manifest,
    ObjectEntry,
    VerifyReport,
)
from checkpoint.fsspec_storage import Location
from checkpoint.manifest import decode_manifest, encode_manifest
from checkpoint.restore_reads import fetch_and_verify
from checkpoint.verification import verification_of

log = logging.getLogger(__name__)

_STEP_DIR_RE = re.compile(rf"^{re.escape(STEP_DIR_PREFIX)}(\d+)-([0-9a-f]+)$")


def step_dir_name(step: int, token: str) -> str:
    """Directory name of a save: ``step-<10-digit step>-<token>``."""
    return f"{STEP_DIR_PREFIX}{step:010d}-{token}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory name, or None if it is not one."""
    m = _STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


#: Hex digits of a token that are random; a run's tag of as many digits comes first.
_RANDOM_HEX = 8


def lineage_tag(run_id: str) -> str | None:
    """The 8 hex digits that begin the tokens of ``run_id``'s saves (None for no run id)."""
    if not run_id:
        return None
    return hashlib.sha256(run_id.encode()).hexdigest()[:_RANDOM_HEX]


def new_token(run_id: str = "") -> str:
    """A fresh directory token: ``<lineage tag><8 random hex>``, or 8 random hex without a run."""
    return (lineage_tag(run_id) or "") + secrets.token_hex(_RANDOM_HEX // 2)


def lineage_of(name: str) -> str | None:
    """The lineage tag in a checkpoint directory's name (None: saved without a run id)."""
    m = _STEP_DIR_RE.match(name)
    if m is None or len(m.group(2)) != 2 * _RANDOM_HEX:
        return None
    return m.group(2)[:_RANDOM_HEX]


def write_manifest(
    directory: Location, manifest: Manifest, fence: CommitFence | None = None
) -> None:
    """Write the manifest: the commit point of a checkpoint.

    On local disks the bytes go to a temporary name first and are renamed, so
    a crash never leaves a torn ``manifest.json``; on object stores a PUT is
    atomic already.  (A torn manifest would fail its self-checksum anyway.)

    Args:
        fence: checked last, right before the write; a saver that was fenced
            out of the job (a newer membership generation, or no way to prove
            it still belongs) gets :class:`~checkpoint.api.CommitFencedError`
            and the checkpoint stays uncommitted.

    Raises:
        CommitFencedError: the fence refused the commit.
        CheckpointStorageError: the manifest could not be written.
    """
    data = encode_manifest(manifest)
    if fence is not None:
        fence()
    target = directory.path(MANIFEST_NAME)
    try:
        if directory.is_local:
            tmp = directory.path(f".{MANIFEST_NAME}.tmp")
            with directory.fs.open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            directory.fs.mv(tmp, target)
        else:
            directory.fs.pipe_file(target, data)
    except OSError as e:
        raise CheckpointStorageError(
            f"could not write {directory.url_of(MANIFEST_NAME)}: {e}"
        ) from e


def read_manifest(directory: Location) -> Manifest:
    """Read and parse the manifest of a checkpoint directory.

    Raises:
        FileNotFoundError: there is no manifest (never committed).
        CheckpointCorruptError: the manifest is unreadable.
    """
    data = directory.fs.cat_file(directory.path(MANIFEST_NAME))
    return decode_manifest(data, where=directory.url_of(MANIFEST_NAME))


def _sizes(directory: Location) -> dict[str, int]:
    """Size of every object under ``directory``, by path relative to it (one listing)."""
    out: dict[str, int] = {}
    for entry in directory.fs.find(directory.root, detail=True).values():
        name = str(entry["name"])
        rel = name[len(directory.root) :].lstrip("/")
        out[rel] = int(entry.get("size") or 0)
    return out


def completeness_problem(
    directory: Location, manifest: Manifest, sizes: dict[str, int] | None = None
) -> str | None:
    """Why the objects listed in ``manifest`` are not all there, or None if they are.

    ``sizes`` is the listing of ``directory`` when the caller has it already.
    """
    sizes = _sizes(directory) if sizes is None else sizes
    for obj in manifest.objects:
        if obj.path not in sizes:
            return f"object {obj.path} is missing"
        if sizes[obj.path] != obj.size:
            return f"object {obj.path} has {sizes[obj.path]} bytes, manifest says {obj.size}"
    return None


def inspect_checkpoint(root: Location, name: str) -> CheckpointInfo:
    """Look at one checkpoint directory under ``root``: committed or not, and what is known
    of its verification (from the markers; no object is read)."""
    step = parse_step_dir(name)
    if step is None:
        raise ValueError(f"{name!r} is not a checkpoint directory name")
    directory = root.child(name)
    try:
        manifest = read_manifest(directory)
    except FileNotFoundError:
        return CheckpointInfo(directory.url, name, step, problem="no manifest (never committed)")
    except CheckpointCorruptError as e:
        return CheckpointInfo(directory.url, name, step, problem=str(e))
    if manifest.step != step:
        return CheckpointInfo(
            directory.url, name, step, problem=f"manifest says step {manifest.step}"
        )
    sizes = _sizes(directory)
    problem = completeness_problem(directory, manifest, sizes)
    if problem is not None:
        return CheckpointInfo(directory.url, name, step, problem=problem)
    return CheckpointInfo(
        directory.url, name, step, manifest=manifest, verification=verification_of(sizes)
    )


def list_checkpoints(root: Location, *, list_unreadable: bool = False) -> list[CheckpointInfo]:
    """Every checkpoint directory under ``root``, committed or not, oldest first.

    Order is by step, then by manifest time (uncommitted directories of the
    same step sort first).

    Args:
        list_unreadable: a directory that cannot be read is listed, as not
            committed with the error as its problem, instead of failing the
            whole listing.  For showing a root only: a restore or retention
            must not take an unreadable checkpoint for one that was never
            committed (the first would pass over newer work, the second
            delete it).

    Raises:
        CheckpointStorageError: the root cannot be listed, or (unless
            ``list_unreadable``) one of its checkpoint directories cannot be read.
    """
    root.refresh()
    try:
        entries = root.fs.ls(root.root, detail=True)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CheckpointStorageError(f"cannot list {root.url}: {e}") from e
    infos = []
    for entry in entries:
        if entry.get("type") != "directory":
            continue
        name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        if parse_step_dir(name) is None:
            continue
        try:
            infos.append(inspect_checkpoint(root, name))
        except OSError as e:
            if not list_unreadable:
                raise CheckpointStorageError(f"cannot read {root.url_of(name)}: {e}") from e
            problem = f"cannot be read ({type(e).__name__}: {e})"
            step = parse_step_dir(name)
            assert step is not None
            infos.append(CheckpointInfo(root.url_of(name), name, step, problem=problem))
    infos.sort(key=lambda i: (i.step, i.manifest.created_at if i.manifest else -1.0, i.name))
    return infos


def committed_checkpoints(root: Location) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root`` that did not fail verification, newest first."""
    return [i for i in reversed(list_checkpoints(root)) if i.usable]


def latest_committed(root: Location) -> CheckpointInfo | None:
    """The newest committed checkpoint under ``root`` not marked as failed, or None."""
    committed = committed_checkpoints(root)
    return committed[0] if committed else None


def verify_objects(
    directory: Location, objects: Sequence[ObjectEntry], algorithm: str = CHECKSUM_ALGORITHM
) -> VerifyReport:
    """Read ``objects`` of a checkpoint directory and compare size and checksum.

    ``algorithm`` is the manifest's ``checksum_algorithm``.  Each object is
    streamed through its checksum; nothing is kept.
    """
    report, _ = fetch_and_verify(directory, objects, algorithm, keep=(), budget=0)
    return report


def verify_checkpoint(directory: Location, *, rank: int = 0, world_size: int = 1) -> VerifyReport:
    """Verify a checkpoint directory (this rank's share of its objects).

    Raises:
        CheckpointCorruptError: there is no valid manifest to verify against.
    """
    try:
        manifest = read_manifest(directory)
    except FileNotFoundError as e:
        raise CheckpointCorruptError(
            f"{directory.url} has no {MANIFEST_NAME}; it was never committed"
        ) from e
    share = manifest.objects[rank::world_size]
    started = time.monotonic()
    report = verify_objects(directory, share, manifest.checksum_algorithm)
    log.debug(
        "verified %d objects (%d bytes) of %s in %.2fs: %s",
        len(share),
        report.checked_bytes,
        directory.url,
        time.monotonic() - started,
        "ok" if report.ok else "; ".join(report.problems),
    )
    return report
