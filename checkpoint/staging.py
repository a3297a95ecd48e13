"""Staging: copy the tensors this rank will write into reusable CPU buffers.

Staging is the only part of an asynchronous save that the training loop waits
for.  Only the keys this rank owns are copied (replicated state is split
across ranks), and buffers are kept between saves so that steady-state
staging is a plain memory copy with no allocation or page faults.  Buffers
are pinned when CUDA is present so device-to-host copies run at full speed.

A sharded tensor (a ``DTensor`` of an FSDP2 model) is staged as its local
slice and handed to DCP as a ``DTensor`` of the same mesh and placements
around the staging buffer, so the checkpoint records where the slice sits.

Device tensors are copied on a side stream: the copy is ordered after the
work already queued on the training stream (so it sees this step's values)
and before any work queued after it (so the next optimizer step cannot
change a tensor the copy still reads), and the training thread does not wait
for it to finish.  The upload waits for it (:meth:`Stager.wait_copied`)
before reading the buffers.  When pinned memory runs out, the remaining
buffers are plain host memory and their copies finish before :meth:`stage`
returns.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


def _around(buf: torch.Tensor, like: DTensor) -> DTensor:
    """``buf`` (a copy of ``like``'s local slice) as a DTensor placed as ``like`` is."""
    return DTensor.from_local(
        buf,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


class Stager:
    """Copies selected entries of a flat state into buffers it owns.

    A buffer is reused by the next save, so a staged dict must not be used
    after the next :meth:`stage` call; the checkpointer guarantees that by
    running one upload at a time.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pin = torch.cuda.is_available()
        self._stream: Any = None  # torch.cuda.Stream, made on the first device copy
        self._copied: Any = None  # torch.cuda.Event of the last stage's device copies

    @property
    def staged_bytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer_for(self, key: str, value: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            try:
                buf = torch.empty(value.shape, dtype=value.dtype, pin_memory=self._pin)
            except RuntimeError as e:  # pinned memory exhausted: plain memory, slower copies
                log.warning("staging %s in pageable memory: %s", key, e)
                self._pin = False
                buf = torch.empty(value.shape, dtype=value.dtype)
            self._buffers[key] = buf
        return buf

    def allocate(self, flat: Mapping[str, Any], keys: Iterable[str]) -> None:
        """Create (and touch) the buffers :meth:`stage` will need, without copying."""
        for key in keys:
            value = flat[key]
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                self._buffer_for(key, value).zero_()

    def stage(self, flat: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
        """Copy ``flat[key]`` for each key; tensors into owned buffers, objects deep-copied."""
        wanted = set(keys)
        for stale in set(self._buffers) - wanted:
            del self._buffers[stale]
        staged: dict[str, Any] = {}
        device_copies = False
        self.wait_copied()  # the buffers are reused: the last save's copies must be done
        with torch.no_grad():
            for key in wanted:
                value = flat[key]
                sharded = value if isinstance(value, DTensor) else None
                if sharded is not None:
                    value = sharded.to_local()
                if isinstance(value, torch.Tensor):
                    buf = self._buffer_for(key, value)
                    if value.is_cuda and buf.is_pinned():
                        self._copy_on_side_stream(buf, value, first=not device_copies)
                        device_copies = True
                    else:
                        buf.copy_(value)
                    staged[key] = buf if sharded is None else _around(buf, sharded)
                elif isinstance(value, bytes | int | float | str):
                    staged[key] = value
                else:
                    staged[key] = copy.deepcopy(value)
        if device_copies:
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)
            # later work on the training stream (the next optimizer step) waits on
            # the GPU for the copies; the training thread does not
            torch.cuda.current_stream().wait_event(self._copied)
        return staged

    def _copy_on_side_stream(self, buf: torch.Tensor, value: torch.Tensor, first: bool) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        if first:
            self._stream.wait_stream(torch.cuda.current_stream())  # after this step's work
        with torch.cuda.stream(self._stream):
            buf.copy_(value, non_blocking=True)
        value.record_stream(self._stream)  # not reused by the allocator before the copy

    def wait_copied(self) -> None:
        """Block until the last :meth:`stage`'s device copies are in the buffers."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def release(self) -> None:
        """Drop all buffers (memory is returned once uploads holding them finish)."""
        self._buffers.clear()
