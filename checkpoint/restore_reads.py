"""Read a checkpoint's objects once on restore: fetch, verify, then load from memory.

A restore must not put a byte of a checkpoint into the state before every
object it came from matched the manifest.  Verifying by streaming each object
through its checksum and then letting DCP read it again costs two reads of
the whole checkpoint, and DCP's reads are one seek and a few small reads per
tensor: on an object store, a ranged request each.  So each rank fetches the
objects it will load whole, one request (or one file read) each, checksums
the bytes it holds, and, once every rank agrees that the checkpoint
verifies, DCP loads from those verified bytes: nothing reaches the state
before the verdict, and every object is read once.  On a local disk the
objects are mapped instead of read (:func:`map_object`): the checksum and
then the load read the page cache directly, and no memory of the process
holds a copy.  Each tensor is then copied once, from the verified bytes into
the state (:class:`checkpoint.location_reader.LocationReader`).

Which objects a rank will load comes from DCP's own load plan for its state
(a rank of a sharded model loads only the objects its slices are in).  The
fetched bytes live until the load is done, so their total is bounded
(``budget``, by default half of the memory available when the restore
starts; mapped objects take none of it); objects past it are verified by
streaming and read again by DCP.  Runs in the training process, inside
:func:`checkpoint.durable.restore_durable`.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from checkpoint.api import CheckpointStorageError, ObjectEntry, VerifyReport
from checkpoint.checksums import checksum_buffer
from checkpoint.flat_state import is_rank_key
from checkpoint.fsspec_storage import Buffer, Location

__all__ = [
    "default_budget",
    "fetch_and_verify",
    "map_object",
    "mappable",
    "planned_objects",
    "resident_share",
]

log = logging.getLogger(__name__)

#: Share of the memory available that fetched objects may take when no budget is given.
DEFAULT_BUDGET_SHARE = 0.5

#: Share of a mapped object's pages that must be in the page cache for its checksum to
#: run on several cores: one that must come from disk is read in one sequential pass
#: (two readers of one file defeat the kernel's read-ahead: measured 0.47 s against
#: 0.8 s for 1 GB from disk, 0.10 s against 0.06 s from the page cache).
PARALLEL_RESIDENT_SHARE = 0.9

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def default_budget() -> int:
    """Half of ``MemAvailable`` (Linux), or 0 (fetch nothing) where it cannot be read."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return 0
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(int(m.group(1)) * 1024 * DEFAULT_BUDGET_SHARE) if m else 0


def planned_objects(target: Mapping[str, Any], metadata: Any) -> set[str]:
    """Paths (relative to the checkpoint directory) of the objects DCP will read to fill
    ``target`` from a checkpoint with DCP ``metadata``: its local plan, as it loads
    (a rank's own entry the checkpoint lacks is left out, as the load leaves it out).

    Empty when no plan can be made: the load then reports why, and reads from storage.
    """
    available = metadata.state_dict_metadata
    wanted = {k: v for k, v in target.items() if not (is_rank_key(k) and k not in available)}
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        planner.set_up_planner(wanted, metadata, is_coordinator=False)
        items = planner.create_local_plan().items
    except Exception as e:  # a state the checkpoint does not fit: load_into says so
        log.debug("no load plan for the objects to fetch: %s", e)
        return set()
    storage = metadata.storage_data or {}
    paths = set()
    for item in items:
        info = storage.get(item.storage_index)
        if info is not None:
            paths.add(str(info.relative_path))
    return paths


def map_object(path: str) -> Buffer:
    """Map a local object read-only (shared: the page cache itself, no copy); an empty
    object, which cannot be mapped, is ``b""``.

    A committed checkpoint's objects are never written again (a new
    checkpoint goes to a new directory, retention unlinks whole files), so
    the bytes verified through the mapping are the bytes loaded from it.
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    mapped.madvise(mmap.MADV_SEQUENTIAL)
    return mapped


def resident_share(mapped: mmap.mmap, path: str) -> float:
    """Share of the pages of ``path``'s mapping that are in the page cache (``mincore``);
    0.0 where that cannot be told (Linux tells only for a file the process owns or could
    write, and says "all resident" for the others)."""
    try:
        st = os.stat(path)
    except OSError:
        return 0.0
    if os.geteuid() not in (0, st.st_uid) and not os.access(path, os.W_OK):
        return 0.0
    size = len(mapped)
    if size == 0:
        return 1.0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = np.zeros(pages, dtype=np.uint8)
    address = np.frombuffer(mapped, dtype=np.uint8).ctypes.data  # the mapping's start, no copy
    if _libc.mincore(address, size, vector.ctypes.data) != 0:
        return 0.0
    return float(np.count_nonzero(vector & 1)) / pages


def mappable(directory: Location) -> bool:
    """True where objects are mapped: fsspec's own local filesystem (not a subclass of
    it, which may count or change what is read)."""
    return type(directory.fs) is LocalFileSystem


def _read_whole(directory: Location, path: str) -> Buffer:
    if mappable(directory):
        try:
            return map_object(path)
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as e:  # a filesystem that cannot map: read it
            log.debug("cannot map %s, reading it: %s", path, e)
    return bytes(directory.fs.cat_file(path))  # no copy of what cat_file gave


def fetch_and_verify(
    directory: Location,
    objects: Sequence[ObjectEntry],
    algorithm: str,
    keep: Iterable[str],
    budget: int,
) -> tuple[VerifyReport, dict[str, Buffer]]:
    """Check ``objects`` against their manifest entries, keeping the bytes of those in ``keep``.

    On a local disk (:func:`mappable`) every object is mapped and checksummed through the
    mapping, and the mappings of those in ``keep`` are kept.  Elsewhere an
    object in ``keep`` is read whole while the bytes kept so far plus its own
    stay within ``budget``, and checksummed in memory; any other object is
    streamed through its checksum (:meth:`Location.checksum_object`).

    Returns:
        The report, and the bytes of each kept object that matched, by
        filesystem path (what :class:`checkpoint.location_reader.LocationReader`
        takes as ``fetched``).  A mismatch keeps nothing of that object.

    Raises:
        CheckpointStorageError: an object could not be read (not a finding).
    """
    wanted = set(keep)
    fetched: dict[str, Buffer] = {}
    left = budget
    problems: list[str] = []
    checked = 0
    for obj in objects:
        path = directory.path(obj.path)
        try:
            data: Buffer = b""
            if mappable(directory) or (obj.path in wanted and obj.size <= left):
                data = _read_whole(directory, path)
                cached = not isinstance(data, mmap.mmap) or (
                    resident_share(data, path) >= PARALLEL_RESIDENT_SHARE
                )
                size, checksum = checksum_buffer(data, algorithm, threads=None if cached else 1)
                if obj.path not in wanted:
                    data = b""  # verified only: a mapping is closed when dropped
            else:
                size, checksum = directory.checksum_object(path, algorithm)
        except FileNotFoundError:
            problems.append(f"{obj.path}: missing")
            continue
        except OSError as e:
            raise CheckpointStorageError(f"cannot read {directory.url_of(obj.path)}: {e}") from e
        checked += size
        if size != obj.size:
            problems.append(f"{obj.path}: {size} bytes, manifest says {obj.size}")
        elif checksum != obj.checksum:
            problems.append(f"{obj.path}: checksum {checksum}, manifest says {obj.checksum}")
        elif data:
            fetched[path] = data
            left -= size if isinstance(data, bytes) else 0
    report = VerifyReport(
        url=directory.url, ok=not problems, problems=tuple(problems), checked_bytes=checked
    )
    return report, fetched
