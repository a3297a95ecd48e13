"""Restore from the freshest valid source: node memory, a live peer, or durable storage.

All ranks call :func:`restore` together.  Each rank reports the step its
memory tier holds; rank 0 reports the newest committed durable step.  Then:

* if the newest memory step is at least as new as durable storage and every
  rank holds it, each rank loads its own memory copy (``MEMORY``);
* if only some ranks hold it, those load locally and one of them broadcasts
  the replicated state to the rest (``PEER``); ranks without it keep their
  per-rank state as it is;
* otherwise the newest committed checkpoint that verifies is loaded from
  durable storage, falling back to older ones (``DURABLE``);
* with nothing anywhere, the state is left untouched (``NONE``).
"""

from __future__ import annotations

import logging

from checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    RestoreResult,
    RestoreSource,
    TrainState,
)
from checkpoint.commit import latest_committed
from checkpoint.durable import restore_durable
from checkpoint.flat_state import SAMPLES_KEY, apply, capture, is_rank_key, rank_key
from checkpoint.fsspec_storage import Location
from checkpoint.groups import Coordination
from checkpoint.memory_tier import SharedMemoryTier
from checkpoint.peer import broadcast_replicated

log = logging.getLogger(__name__)


def _memory_step(memory: SharedMemoryTier | None, target: dict[str, object]) -> int | None:
    if memory is None:
        return None
    step = memory.latest_step()
    if step is None:
        return None
    held = memory.keys()
    if any(k not in held for k in target if not is_rank_key(k)):
        log.warning(
            "memory tier at %s does not match the current state; ignoring it", memory.directory
        )
        return None
    return step


def restore(
    state: TrainState,
    coord: Coordination,
    *,
    root: Location | None,
    memory: SharedMemoryTier | None = None,
    url: str | None = None,
) -> RestoreResult:
    """Restore ``state`` in place from the freshest valid tier (collective).

    Args:
        state: live training state; filled in place.
        coord: checkpoint groups (all ranks call together).
        root: durable checkpoint root, or None for memory/peer only.
        memory: this rank's memory tier, if any.
        url: restore this durable checkpoint directory (under ``root``) instead
            of choosing; it must verify, there is no falling back.

    Returns:
        Which source was used and the restored step and data position.
    """
    target, mapping = capture(state, coord.rank)
    mine = _memory_step(memory, target) if url is None else None
    steps: list[int | None] = coord.all_gather(mine, coord.control)
    durable_step: int | None = None
    if root is not None and url is None and coord.is_coordinator:
        try:
            latest = latest_committed(root)
            durable_step = latest.step if latest else None
        except CheckpointError as e:
            log.warning("cannot list %s (%s); using memory or peers only", root.url, e)
    durable_step = coord.broadcast(durable_step, coord.control)
    best = max((s for s in steps if s is not None), default=None)

    if best is not None and (durable_step is None or best >= durable_step):
        have = [s == best for s in steps]
        if have[coord.rank] and memory is not None:
            memory.load(best, target)
        elif rank_key(coord.rank) in target:
            del target[rank_key(coord.rank)]
        if all(have):
            source = RestoreSource.MEMORY
        else:
            broadcast_replicated(target, have.index(True), coord)
            source = RestoreSource.PEER
        restored_rank = apply(state, target, mapping, coord.rank)
        log.info("restored step %d from %s", best, source.value)
        return RestoreResult(
            source=source,
            step=best,
            samples_seen=int(target[SAMPLES_KEY]),
            rank_state_restored=restored_rank,
        )

    if root is None:
        return RestoreResult(source=RestoreSource.NONE, step=None, samples_seen=state.samples_seen)
    outcome = restore_durable(root, target, coord, url=url)
    if outcome.manifest is None and url is not None:
        raise CheckpointCorruptError(
            f"the checkpoint asked for, {url}, cannot be used: {'; '.join(outcome.skipped)}"
        )
    if outcome.manifest is None:
        log.info("no usable checkpoint under %s; starting fresh", root.url)
        return RestoreResult(
            source=RestoreSource.NONE,
            step=None,
            samples_seen=state.samples_seen,
            skipped=outcome.skipped,
        )
    restored_rank = apply(state, target, mapping, coord.rank)
    return RestoreResult(
        source=RestoreSource.DURABLE,
        step=outcome.manifest.step,
        samples_seen=state.samples_seen,
        url=outcome.url,
        rank_state_restored=restored_rank,
        skipped=outcome.skipped,
    )
