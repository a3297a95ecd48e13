"""A delayed sync's outer state in durable checkpoints (runs in the training process).

Under ``sync.mode`` diloco or streaming_diloco the sites' models differ
between outer steps, so the first site's ranks alone write the model, the
optimizer and the tracked objects (:func:`first_site`).  A DDP model's outer
state is its site's: it is saved as a tracked object like any other.  With
an FSDP2 model in each site each rank's outer state is its slice's
(:func:`~agents.sync.outer_sync.per_slice`): it goes into the rank's own part
of the checkpoint with the sites it was saved on (:func:`outer_rank_state`),
and a resume loads it on each rank where the sites are the same
(:func:`restore_outer`; :mod:`agents.recovery.site_shards` then hands the
first site's to the others, whose model is the first site's now); on other
sites :mod:`agents.recovery.outer_reshard` cuts the first site's parts to the
new slices.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from agents.sync.outer_sync import OuterSync, per_slice

__all__ = ["OUTER_STATE", "first_site", "outer_rank_state", "replicated", "restore_outer"]

log = logging.getLogger("ringmaster.worker")

#: Key of a slice's outer state in a rank's own part of a checkpoint.
OUTER_STATE = "outer"


def first_site(outer: object) -> tuple[int, ...] | None:
    """Under a delayed sync, the first site's ranks: they alone write the model (the
    sites' models differ between syncs, and a checkpoint holds one site's)."""
    groups = outer.groups if isinstance(outer, OuterSync) else None
    return groups.sites.ranks[0] if groups is not None else None


def replicated(tracked: Mapping[str, Any], own: tuple[str, ...]) -> dict[str, Any]:
    """The tracked objects saved as replicated ones: all but ``own`` fields and a
    slice's outer state (each rank's own)."""
    return {k: v for k, v in tracked.items() if k not in own and not per_slice(v)}


def outer_rank_state(outer: object) -> dict[str, Any]:
    """What a slice's outer state adds to this rank's own part of a checkpoint."""
    if not isinstance(outer, OuterSync) or not per_slice(outer) or outer.groups is None:
        return {}
    sites = [list(r) for r in outer.groups.sites.ranks]
    return {OUTER_STATE: {"sites": sites, "state": outer.state_dict()}}


def restore_outer(outer: object, rank_state: Mapping[str, Any]) -> None:
    """After a restore: load this rank's slice's outer state when the checkpoint's sites
    are this generation's (``outer.saved_sites`` says what it found, for the join to
    compare across ranks)."""
    if not isinstance(outer, OuterSync) or not per_slice(outer) or outer.groups is None:
        return
    saved = rank_state.get(OUTER_STATE)
    outer.saved_sites = saved["sites"] if saved is not None else None
    outer.saved_piece = None
    if saved is not None and saved["sites"] == [list(r) for r in outer.groups.sites.ranks]:
        outer.fit()
        outer.load_state_dict(saved["state"])
    elif saved is not None:  # other sites: agents.recovery.outer_reshard cuts it anew
        outer.saved_piece = saved
