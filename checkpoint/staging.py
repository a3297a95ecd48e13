"""Staging: copy the tensors this rank will write into reusable CPU buffers.

Staging is the only part of an asynchronous save that the training loop waits
for.  Only the keys this rank owns are copied (replicated state is split
across ranks), and buffers are kept between saves so that steady-state
staging is a plain memory copy with no allocation or page faults.  Buffers
are pinned when CUDA is present so device-to-host copies run at full speed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch


class Stager:
    """Copies selected entries of a flat state into buffers it owns.

    A buffer is reused by the next save, so a staged dict must not be used
    after the next :meth:`stage` call; the checkpointer guarantees that by
    running one upload at a time.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pin = torch.cuda.is_available()

    @property
    def staged_bytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer_for(self, key: str, value: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=self._pin)
            self._buffers[key] = buf
        return buf

    def allocate(self, flat: Mapping[str, Any], keys: Iterable[str]) -> None:
        """Create (and touch) the buffers :meth:`stage` will need, without copying."""
        for key in keys:
            value = flat[key]
            if isinstance(value, torch.Tensor):
                self._buffer_for(key, value).zero_()

    def stage(self, flat: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
        """Copy ``flat[key]`` for each key; tensors into owned buffers, objects deep-copied."""
        wanted = set(keys)
        for stale in set(self._buffers) - wanted:
            del self._buffers[stale]
        staged: dict[str, Any] = {}
        with torch.no_grad():
            for key in wanted:
                value = flat[key]
                if isinstance(value, torch.Tensor):
                    buf = self._buffer_for(key, value)
                    buf.copy_(value, non_blocking=self._pin)
                    staged[key] = buf
                elif isinstance(value, bytes | int | float | str):
                    staged[key] = value
                else:
                    staged[key] = copy.deepcopy(value)
        if self._pin:
            torch.cuda.synchronize()
        return staged

    def release(self) -> None:
        """Drop all buffers (memory is returned once uploads holding them finish)."""
        self._buffers.clear()
