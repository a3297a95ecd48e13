"""Single-tensor gather and scatter collectives under every supported torch.

torch 2.13 calls them ``all_gather_single`` and ``reduce_scatter_single``; the
releases before it (2.7 to 2.12, see docs/compatibility.md) have the same
calls, with the same arguments, as ``all_gather_into_tensor`` and
``reduce_scatter_tensor``.  The hooks use the names here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
reduce_scatter_single: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
