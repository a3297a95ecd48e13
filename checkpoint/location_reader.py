"""DCP's file-system reader on a :class:`Location`, copying verified bytes once into the state.

A restore first fetches (or, on a local disk, maps) every object it will load
and checks it against the manifest (:mod:`checkpoint.restore_reads`); DCP then
loads from those bytes.  DCP's own reader does that with ``torch.load`` per
tensor: the storage is copied out of the record into new memory, then copied
into the state.  For each tensor in an object held in memory this reader
instead finds the saved storage in place (:func:`checkpoint.tensor_records.tensor_in_record`)
and copies it straight into the state tensor DCP names, once.  Everything
else (byte objects, records in another form, objects that were not held,
items with DCP storage transforms) goes through DCP's reader as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from checkpoint.fsspec_storage import Buffer, Location, _FsspecObjects
from checkpoint.tensor_records import tensor_in_record

__all__ = ["LocationReader"]


class LocationReader(FileSystemReader):
    """DCP's file-system reader over a :class:`Location`'s filesystem object.

    Args:
        location: the checkpoint directory.
        fetched: objects already read whole (or mapped) and verified, by
            filesystem path (:func:`checkpoint.restore_reads.fetch_and_verify`):
            DCP reads them from memory.
    """

    def __init__(self, location: Location, fetched: Mapping[str, Buffer] | None = None) -> None:
        super().__init__(location.root)
        self.fetched = dict(fetched or {})
        self.fs = _FsspecObjects(location.fs, fetched=self.fetched)  # type: ignore[assignment]
        self.path = location.root
        #: Tensor items copied straight from held bytes, and those left to DCP's reader.
        self.direct_items = 0
        self.dcp_items = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rest = [req for req in plan.items if not self._read_held(req, planner)]
        self.dcp_items += sum(1 for r in rest if r.type != LoadItemType.BYTE_IO)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_held(self, req: ReadItem, planner: LoadPlanner) -> bool:
        """Copy ``req`` from held bytes into its state tensor; False: leave it to DCP."""
        if req.type == LoadItemType.BYTE_IO:
            return False
        info: Any = self.storage_data[req.storage_index]
        held = self.fetched.get(str(self.fs.concat_path(self.path, info.relative_path)))
        if held is None or info.transform_descriptors:
            return False
        record = memoryview(held)[info.offset : info.offset + info.length]
        saved = tensor_in_record(record)
        if saved is None:
            return False
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            saved = saved.narrow(dim, start, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != saved.size():
            raise AssertionError(
                f"{req.storage_index}: the checkpoint holds {tuple(saved.size())}, "
                f"the state expects {tuple(target.size())}"
            )
        with torch.no_grad():
            target.copy_(saved)
        planner.commit_tensor(req, target)
        self.direct_items += 1
        return True
