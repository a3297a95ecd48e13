"""Restore from durable storage: pick the newest committed checkpoint that verifies, load it.

Rank 0 lists committed checkpoints and tells the others; every rank then
checks its share of the candidate's objects against the manifest (so the
read cost of verification is spread), and all ranks agree before loading.  A
candidate that fails (a flipped byte, a missing object) is logged, marked as
failed beside its manifest (:mod:`checkpoint.verification`; from then on no
restore or retention counts it), and the previous committed checkpoint is
tried; one that verifies is marked verified.  A candidate that could not be
read (storage unreachable) is passed over without a mark: that is no finding
about its objects.  Loading uses DCP, which reshards: the checkpoint's world
size need not match the current one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from torch.distributed.checkpoint.api import CheckpointException

from checkpoint import dcp_calls
from checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    Manifest,
)
from checkpoint.commit import (
    committed_checkpoints,
    inspect_checkpoint,
    parse_step_dir,
    read_manifest,
    verify_checkpoint,
)
from checkpoint.dcp_errors import describe
from checkpoint.flat_state import FlatState, check_fits, is_rank_key
from checkpoint.fsspec_storage import Location, LocationReader
from checkpoint.groups import Coordination
from checkpoint.verification import record

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DurableRestore:
    """Which checkpoint a durable restore used and which it passed over.

    Attributes:
        manifest: manifest of the checkpoint loaded (None when none was usable).
        url: its directory URL.
        skipped: ``"<name>: <reason>"`` for each committed checkpoint rejected.
        seconds: time spent finding candidates (``find``), verifying them
            (``verify``, every candidate tried) and loading the one used (``load``).
    """

    manifest: Manifest | None
    url: str | None
    skipped: tuple[str, ...]
    seconds: dict[str, float] = field(default_factory=dict)


def load_into(directory: Location, target: FlatState, coord: Coordination) -> None:
    """Fill ``target`` from a checkpoint directory (collective over ``coord``).

    Tensors are filled in place; objects are replaced.  This rank's own
    ``rank.<r>`` entry is dropped from ``target`` when the checkpoint has none
    (it was saved by fewer ranks).

    Raises:
        CheckpointMismatchError: the checkpoint lacks entries the state expects.
        CheckpointStorageError: reading failed.
    """
    reader = LocationReader(directory)
    try:
        metadata = reader.read_metadata()
    except OSError as e:
        raise CheckpointStorageError(f"cannot read metadata of {directory.url}: {e}") from e
    available = metadata.state_dict_metadata
    check_fits(target, available, directory.url)
    for key in [k for k in target if is_rank_key(k) and k not in available]:
        del target[key]
    try:
        dcp_calls.load(target, reader, coord.control if coord.distributed else None)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointStorageError(f"loading {directory.url} failed: {describe(e)}") from e


def _candidates(root: Location, url: str | None) -> list[str]:
    if url is None:
        return [i.name for i in committed_checkpoints(root)]
    name = url.rstrip("/").rsplit("/", 1)[-1]
    if parse_step_dir(name) is None:
        raise CheckpointNotFoundError(f"{url} is not a checkpoint directory (step-<n>-<token>)")
    info = inspect_checkpoint(root, name)
    if not info.committed:
        raise CheckpointNotFoundError(f"{url} is not committed: {info.problem}")
    if not info.usable:
        raise CheckpointNotFoundError(
            f"{url} failed verification before (it is marked so); "
            f"`ringmaster checkpoints verify {url}` checks it again"
        )
    return [name]


def _check_share(directory: Location, coord: Coordination) -> tuple[list[str], bool]:
    """This rank's problems with its share of ``directory``, and whether they are findings
    about the objects (True) rather than storage that could not be read (False)."""
    try:
        report = verify_checkpoint(directory, rank=coord.rank, world_size=coord.world_size)
    except CheckpointCorruptError as e:  # a manifest gone meanwhile is no finding either
        return [str(e)], not isinstance(e.__cause__, FileNotFoundError)
    except (CheckpointError, OSError) as e:
        return [str(e)], False
    return list(report.problems), True


def restore_durable(
    root: Location, target: FlatState, coord: Coordination, *, url: str | None = None
) -> DurableRestore:
    """Load the newest committed checkpoint under ``root`` that verifies (collective).

    Args:
        root: checkpoint root.
        target: flat state to fill (see :func:`load_into`).
        coord: checkpoint groups; every rank calls together.
        url: a specific checkpoint directory under ``root`` instead of the newest.

    Returns:
        What was loaded; ``manifest`` is None when nothing committed verified.
    """
    started = time.perf_counter()
    seconds = {"find": 0.0, "verify": 0.0}
    names: list[str] | str = []
    if coord.is_coordinator:
        try:
            names = _candidates(root, url)
        except CheckpointError as e:
            names = f"{type(e).__name__}: {e}"
    names = coord.broadcast(names, coord.control)
    if isinstance(names, str):
        raise CheckpointNotFoundError(names)
    seconds["find"] = time.perf_counter() - started
    skipped: list[str] = []
    for name in names:
        directory = root.child(name)
        started = time.perf_counter()
        shares = coord.all_gather(_check_share(directory, coord), coord.control)
        seconds["verify"] += time.perf_counter() - started
        all_problems = [p for ps, _ in shares for p in ps]
        corrupt = [p for ps, finding in shares if finding for p in ps]
        if coord.is_coordinator and (corrupt or not all_problems):
            record(directory, corrupt)  # an unreadable share alone is no finding
        if all_problems:
            reason = "; ".join(all_problems)
            log.warning("checkpoint %s failed verification, trying an older one: %s", name, reason)
            skipped.append(f"{name}: {reason}")
            continue
        started = time.perf_counter()
        load_into(directory, target, coord)
        manifest = read_manifest(directory) if coord.is_coordinator else None
        manifest = coord.broadcast(manifest, coord.control)
        seconds["load"] = time.perf_counter() - started
        log.info("restored step %d from %s", manifest.step, directory.url)
        return DurableRestore(manifest, directory.url, tuple(skipped), seconds)
    return DurableRestore(None, None, tuple(skipped), seconds)
