"""The package's two calls into DCP: write a flat state, read one back.

Both go through torch's public ``torch.distributed.checkpoint.save`` and
``load``, with the checkpoint's own process group when ranks work together
and ``no_dist=True`` in a single process (tests, tools, a script run alone).
Everything version-sensitive about DCP's entry points stays in this module.

In a single process DCP warns that it assumes one process, even when told so
with ``no_dist``.  Here that is the intended case, not a forgotten
``init_process_group``, so a warnings filter for that one message is added
(once, process-wide) before such a call; ``warnings.catch_warnings`` would
be scoped, but it is not safe while other threads use warnings, and saves
run on an upload thread.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

#: DCP's note when it saves or loads without a process group (wording of torch 2.7 to 2.14.1).
SINGLE_PROCESS_NOTE = (
    r"torch\.distributed is (disabled, )?unavailable or uninitialized, "
    r"assuming the intent is to (save|load) in a single process"
)


def _hide_single_process_note() -> None:
    for action, message, *_ in warnings.filters:
        if action == "ignore" and getattr(message, "pattern", None) == SINGLE_PROCESS_NOTE:
            return
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTE, category=UserWarning)


def save(state: dict[str, Any], writer: StorageWriter, group: dist.ProcessGroup | None) -> None:
    """Write ``state`` (already flat) through ``writer``.

    Args:
        state: flat state; its keys become DCP's entry names as they are.
        writer: where and how the objects are written.
        group: the ranks that save together, or None for a single process.

    Raises:
        CheckpointException: (DCP's, a ``BaseException``) any rank failed.
    """
    planner = DefaultSavePlanner(flatten_state_dict=False)
    if group is not None:
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
        return
    _hide_single_process_note()
    dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)


def load(state: dict[str, Any], reader: StorageReader, group: dist.ProcessGroup | None) -> None:
    """Fill ``state`` (flat) in place from ``reader``; DCP reshards as needed.

    Args:
        state: flat state to fill; tensors are filled in place, objects replaced.
        reader: where the checkpoint is read from.
        group: the ranks that load together, or None for a single process.

    Raises:
        CheckpointException: (DCP's, a ``BaseException``) any rank failed.
    """
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    if group is not None:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=group)
        return
    _hide_single_process_note()
    dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
