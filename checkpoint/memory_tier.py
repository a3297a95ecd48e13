"""The memory tier: a live copy of this rank's full state in node shared memory.

Written as often as every step, it survives the death of the worker process
(files under ``/dev/shm`` stay until the node reboots), so a worker restarted
on the same node resumes at memory speed, and a peer can serve it to a
replacement (see :mod:`checkpoint.peer`).

Layout of a rank's directory::

    slot-0.bin, slot-1.bin   raw tensor bytes (64-byte aligned) + pickled objects
    head.json                which slot is valid, its step and the layout

A put writes the slot the head does *not* point to, then replaces
``head.json`` atomically (write + rename on a local filesystem).  A crash in
the middle of a put leaves the previous step readable.
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from checkpoint.api import CheckpointMismatchError, CheckpointNotFoundError, RestoreSource
from checkpoint.flat_state import FlatState

_ALIGN = 64
_HEAD = "head.json"


_DIR_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}\Z")


def default_directory(job: str, rank: int) -> Path:
    """``/dev/shm/ringmaster/<job>/rank-<rank>`` (a temp dir where there is no /dev/shm).

    Raises:
        ValueError: ``job`` is not one safe directory name (no ``/``, ``..``, control
            characters), so it cannot point the tier outside its directory.
    """
    if not _DIR_PART_RE.match(job) or ".." in job:
        raise ValueError(
            f"job name {job!r} cannot name the memory tier directory: use 1-128 letters, "
            "digits, '_', '-' or '.', starting with a letter or digit, without '..'"
        )
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / "ringmaster" / job / f"rank-{rank}"


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointMismatchError(f"unknown dtype {name!r} in memory tier layout")
    return value


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SharedMemoryTier:
    """Node-local, double-buffered copy of one rank's flat state.

    Args:
        directory: where the slots live (one directory per rank and job).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._maps: dict[int, torch.Tensor] = {}

    @property
    def name(self) -> RestoreSource:
        return RestoreSource.MEMORY

    def _head(self) -> dict[str, Any] | None:
        try:
            head: dict[str, Any] = json.loads((self.directory / _HEAD).read_text())
            return head
        except (FileNotFoundError, ValueError):
            return None

    def _map(self, slot: int, size: int) -> torch.Tensor:
        mapped = self._maps.get(slot)
        if mapped is not None and mapped.numel() == size:
            return mapped
        path = self.directory / f"slot-{slot}.bin"
        with open(path, "ab") as f:
            f.truncate(size)
        mapped = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._maps[slot] = mapped
        return mapped

    def put(self, step: int, flat: FlatState) -> None:
        """Copy ``flat`` into the inactive slot and make it the current one."""
        head = self._head()
        slot = 1 - int(head["slot"]) if head else 0
        entries: list[dict[str, Any]] = []
        objects: dict[str, Any] = {}
        offset = 0
        for key in sorted(flat):
            value = flat[key]
            if isinstance(value, torch.Tensor):
                size = value.numel() * value.element_size()
                entries.append(
                    {
                        "key": key,
                        "dtype": str(value.dtype),
                        "shape": list(value.shape),
                        "offset": offset,
                        "nbytes": size,
                    }
                )
                offset = _aligned(offset + size)
            else:
                objects[key] = value
        blob = io.BytesIO()
        torch.save(objects, blob)
        objects_bytes = blob.getbuffer()
        total = offset + objects_bytes.nbytes
        mapped = self._map(slot, max(total, 1))
        with torch.no_grad():
            for entry in entries:
                dst = self._view(mapped, entry)
                dst.copy_(flat[entry["key"]])
            mapped[offset:total].copy_(torch.frombuffer(objects_bytes, dtype=torch.uint8))
        new_head = {
            "step": step,
            "slot": slot,
            "entries": entries,
            "objects_offset": offset,
            "objects_nbytes": objects_bytes.nbytes,
        }
        tmp = self.directory / f".{_HEAD}.tmp"
        tmp.write_text(json.dumps(new_head))
        os.replace(tmp, self.directory / _HEAD)

    @staticmethod
    def _view(mapped: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
        start = int(entry["offset"])
        raw = mapped[start : start + int(entry["nbytes"])]
        return raw.view(_dtype(entry["dtype"])).view(entry["shape"])

    def latest_step(self) -> int | None:
        head = self._head()
        return int(head["step"]) if head else None

    def keys(self) -> set[str]:
        """Keys held by the current slot."""
        head = self._head()
        if head is None:
            return set()
        return {e["key"] for e in head["entries"]} | set(self._objects(head))

    def _objects(self, head: dict[str, Any]) -> dict[str, Any]:
        with open(self.directory / f"slot-{int(head['slot'])}.bin", "rb") as f:
            f.seek(int(head["objects_offset"]))
            raw = f.read(int(head["objects_nbytes"]))
        objects: dict[str, Any] = torch.load(io.BytesIO(raw), weights_only=False)
        return objects

    @staticmethod
    def _slot_size(head: dict[str, Any]) -> int:
        return max(int(head["objects_offset"]) + int(head["objects_nbytes"]), 1)

    def load(self, step: int, target: FlatState) -> None:
        """Fill ``target`` from the current slot (tensors in place, objects replaced).

        Raises:
            CheckpointNotFoundError: the tier does not hold ``step``.
            CheckpointMismatchError: shapes or dtypes differ from ``target``.
        """
        head = self._head()
        if head is None or int(head["step"]) != step:
            held = None if head is None else head["step"]
            raise CheckpointNotFoundError(f"memory tier holds step {held}, not {step}")
        mapped = self._map(int(head["slot"]), self._slot_size(head))
        with torch.no_grad():
            for entry in head["entries"]:
                key = entry["key"]
                if key not in target:
                    continue
                src = self._view(mapped, entry)
                dst = target[key]
                if not isinstance(dst, torch.Tensor) or dst.shape != src.shape:
                    raise CheckpointMismatchError(
                        f"memory tier entry {key} has shape {tuple(src.shape)}, "
                        f"state expects {getattr(dst, 'shape', type(dst).__name__)}"
                    )
                dst.copy_(src)
        for key, value in self._objects(head).items():
            if key in target:
                target[key] = value

    def get(self) -> tuple[int, FlatState]:
        """The current step and a private copy of its flat state."""
        head = self._head()
        if head is None:
            raise CheckpointNotFoundError(f"memory tier at {self.directory} is empty")
        mapped = self._map(int(head["slot"]), self._slot_size(head))
        flat: FlatState = {e["key"]: self._view(mapped, e).clone() for e in head["entries"]}
        flat.update(self._objects(head))
        return int(head["step"]), flat

    def clear(self) -> None:
        """Forget the held state (remove head and slots)."""
        self._maps.clear()
        for name in (_HEAD, "slot-0.bin", "slot-1.bin"):
            try:
                (self.directory / name).unlink()
            except FileNotFoundError:
                pass
