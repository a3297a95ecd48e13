"""The peer tier: take the replicated state from a live rank instead of storage.

In data-parallel training every rank holds the full replicated state (model,
optimizer, scheduler), so a replacement rank, or a rank whose node lost its
memory tier, can receive it from any survivor.  :func:`broadcast_replicated`
sends it from one source rank to all others over the checkpoint's gloo group
(one small object broadcast for the non-tensor entries, then the tensors in a
fixed key order).  Per-rank entries (``rank.<r>``) are not sent: they belong
to their own rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from checkpoint.api import CheckpointMismatchError
from checkpoint.flat_state import FlatState, is_rank_key, layout_digest
from checkpoint.groups import Coordination


def broadcast_replicated(target: FlatState, src: int, coord: Coordination) -> None:
    """Make ``target``'s replicated entries equal to rank ``src``'s (collective).

    Args:
        target: this rank's flat state; on ``src`` it holds the state to send,
            elsewhere tensors are overwritten in place and objects replaced.
        src: rank (in the checkpoint group) that sends.
        coord: the checkpoint groups; uses ``control``.

    Raises:
        CheckpointMismatchError: ranks hold differently shaped state.
    """
    if not coord.distributed:
        return
    digests = coord.all_gather(layout_digest(target), coord.control)
    if len(set(digests)) != 1:
        raise CheckpointMismatchError(
            "cannot take state from a peer: ranks hold differently shaped models/optimizers"
        )
    keys = sorted(k for k in target if not is_rank_key(k))
    objects = {k: target[k] for k in keys if not isinstance(target[k], torch.Tensor)}
    objects = coord.broadcast(objects, coord.control, src=src)
    target.update(objects)
    with torch.no_grad():
        for key in keys:
            value = target[key]
            if isinstance(value, torch.Tensor):
                buf = value if value.is_contiguous() else value.contiguous()
                dist.broadcast(buf, group_src=src, group=coord.control)
                if buf is not value:
                    value.copy_(buf)
