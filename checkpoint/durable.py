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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch.distributed.checkpoint.api import CheckpointException

from checkpoint import dcp_calls
from checkpoint.api import (
    MANIFEST_NAME,
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
)
from checkpoint.dcp_errors import describe
from checkpoint.flat_state import FlatState, check_fits, is_rank_key
from checkpoint.fsspec_storage import Buffer, Location
from checkpoint.groups import Coordination
from checkpoint.location_reader import LocationReader
from checkpoint.object_state import match_object_targets
from checkpoint.restore_reads import default_budget, fetch_and_verify, planned_objects
from checkpoint.verification import record

log = logging.getLogger(__name__)

#: DCP's metadata object in a checkpoint directory.
METADATA_NAME = ".metadata"


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


def load_into(
    directory: Location,
    target: FlatState,
    coord: Coordination,
    fetched: Mapping[str, Buffer] | None = None,
) -> None:
    """Fill ``target`` from a checkpoint directory (collective over ``coord``).

    Tensors are filled in place; objects are replaced.  This rank's own
    ``rank.<r>`` entry is dropped from ``target`` when the checkpoint has none
    (it was saved by fewer ranks).  Objects in ``fetched`` (by filesystem
    path, verified) are read from there, the others from storage.

    Raises:
        CheckpointMismatchError: the checkpoint lacks entries the state expects.
        CheckpointStorageError: reading failed.
    """
    reader = LocationReader(directory, fetched)
    try:
        metadata = reader.read_metadata()
    except OSError as e:
        raise CheckpointStorageError(f"cannot read metadata of {directory.url}: {e}") from e
    available = metadata.state_dict_metadata
    match_object_targets(target, available)
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


def _check_share(
    directory: Location, coord: Coordination, target: FlatState, budget: int
) -> tuple[list[str], bool, dict[str, Buffer]]:
    """This rank's problems with ``directory``, whether they are findings about the
    objects (True) rather than storage that could not be read (False), and the
    verified bytes of the objects this rank will load (see :mod:`checkpoint.restore_reads`).

    A rank checks its share of the objects (every ``world``-th one) and each
    object it will load, so that all are checked and none is read twice.
    """
    try:
        manifest = read_manifest(directory)
    except FileNotFoundError:
        return [f"{directory.url} has no {MANIFEST_NAME}; it was never committed"], False, {}
    except CheckpointCorruptError as e:
        return [str(e)], True, {}
    except OSError as e:
        return [f"cannot read {directory.url_of(MANIFEST_NAME)}: {e}"], False, {}
    share = manifest.objects[coord.rank :: coord.world_size]
    try:
        # DCP's metadata first, verified, so that the plan comes from checked bytes
        meta = [o for o in manifest.objects if o.path == METADATA_NAME]
        report, fetched = fetch_and_verify(
            directory, meta, manifest.checksum_algorithm, [METADATA_NAME], budget
        )
        keep: set[str] = set()
        if report.ok and fetched:
            metadata = LocationReader(directory, fetched).read_metadata()
            match_object_targets(target, metadata.state_dict_metadata)
            keep = planned_objects(target, metadata) | {METADATA_NAME}
        objects = [o for o in manifest.objects if (o in share or o.path in keep) and o not in meta]
        left = budget - sum(len(b) for b in fetched.values() if isinstance(b, bytes))
        rest, more = fetch_and_verify(directory, objects, manifest.checksum_algorithm, keep, left)
    except (CheckpointError, OSError) as e:
        return [str(e)], False, {}
    fetched.update(more)
    return [*report.problems, *rest.problems], True, fetched


def restore_durable(
    root: Location,
    target: FlatState,
    coord: Coordination,
    *,
    url: str | None = None,
    budget: int | None = None,
    before_load: Callable[[], None] | None = None,
) -> DurableRestore:
    """Load the newest committed checkpoint under ``root`` that verifies (collective).

    Args:
        root: checkpoint root.
        target: flat state to fill (see :func:`load_into`).
        coord: checkpoint groups; every rank calls together.
        url: a specific checkpoint directory under ``root`` instead of the newest.
        budget: bytes of verified objects this rank may hold to load them
            without reading them again (None: :func:`default_budget`; 0: none).
        before_load: called once a checkpoint verified, before anything is
            loaded into ``target`` (the restore waits for it).

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
        limit = default_budget() if budget is None else budget
        problems, finding, fetched = _check_share(directory, coord, target, limit)
        shares = coord.all_gather((problems, finding), coord.control)
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
        if before_load is not None:
            before_load()
        load_into(directory, target, coord, fetched)
        del fetched
        manifest = read_manifest(directory) if coord.is_coordinator else None
        manifest = coord.broadcast(manifest, coord.control)
        seconds["load"] = time.perf_counter() - started
        log.info("restored step %d from %s", manifest.step, directory.url)
        return DurableRestore(manifest, directory.url, tuple(skipped), seconds)
    return DurableRestore(None, None, tuple(skipped), seconds)
