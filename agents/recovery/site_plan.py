"""Where each site's slices come from at a join, with an FSDP2 model in each site (pure).

Runs in the training process, the same answer on every rank (from what every
rank told on the control group).  :func:`check_sites` says whether the sites
can shard alike; :func:`site_states` says, per site, at which step its state
stands and which of its ranks take their slice from a buddy's copy in the
site, or that the site keeps no state (it then starts from the global model:
:mod:`agents.recovery.site_shards`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agents.api import UnequalSitesError
from agents.recovery.state_sync import NO_STATE
from agents.sync.sites import Sites

__all__ = ["Held", "SiteState", "check_sites", "site_states"]


@dataclass(frozen=True)
class Held:
    """What one rank told at a join.

    Attributes:
        live: the step of its live slice, kept in this generation's layout
            (``NO_STATE``: none).
        state: it held state (a live slice in any layout).
        copy: its ward's copy: ``(step, shards, index)``, or None.
    """

    live: int
    state: bool
    copy: tuple[int, int, int] | None = None

    def encode(self) -> list[int]:
        """As five integers (gathered in one tensor)."""
        step, shards, index = self.copy if self.copy is not None else (NO_STATE, 0, -1)
        return [self.live, int(self.state), step, shards, index]

    @classmethod
    def decode(cls, row: Sequence[int]) -> Held:
        live, state, step, shards, index = (int(v) for v in row)
        return cls(live, bool(state), (step, shards, index) if step != NO_STATE else None)


@dataclass(frozen=True)
class SiteState:
    """Where a site's slices come from.

    Attributes:
        step: the step its ranks' slices stand at (``NO_STATE``: the site keeps no
            state and starts from the global model).
        copies: slice index → the global rank of this site that sends its buddy
            copy of it (the index's own rank kept none: a replacement).
    """

    step: int
    copies: dict[int, int] = field(default_factory=dict)


def check_sites(sites: Sites, label: str) -> None:
    """An FSDP2 model in each site needs sites of one size (rank ``i`` of each holds
    slice ``i``).

    Raises:
        UnequalSitesError: naming each site's size and what to change; the join
            reports it and the controller leaves nodes out until the sites are of one
            size (:mod:`orchestrator.controller.site_balance`), or, where no size
            fits ``nodes.min``, fails the job with this message.
    """
    sizes = {len(r) for r in sites.ranks}
    if len(sizes) > 1:
        each = ", ".join(f"{n}: {len(r)}" for n, r in zip(sites.names, sites.ranks, strict=True))
        raise UnequalSitesError(
            f"sharding='fsdp' under a delayed sync shards the model over each site's ranks "
            f"and syncs slice i between the sites' i-th ranks, so the sites must have as "
            f"many ranks each; by {label} they have {each}: give every site as many nodes "
            "(nodes.min/max, spares per site), or wrap with sharding='ddp'"
        )


def site_states(held: Sequence[Held], sites: Sites) -> list[SiteState]:
    """Per site, where its slices come from (``held``: per global rank).

    A site keeps its state at step ``s`` when the ranks that kept a live slice all
    stand at ``s`` and each slice index whose rank kept none (a replacement) is
    held at ``s`` as a buddy's copy by a rank of the site that kept its own.  Such a
    replacement's outer state comes from the same-index rank of another site that
    kept its own; where no site has one, the replacement's site keeps no state.
    """
    out = [_in_site(held, ranks) for ranks in sites.ranks]
    changed = True
    while changed:  # a site that keeps no state is no source either
        changed = False
        for s, st in enumerate(out):
            if any(not _outer_source(out, index, s) for index in st.copies):
                out[s], changed = SiteState(NO_STATE), True
    return out


def _in_site(held: Sequence[Held], ranks: Sequence[int]) -> SiteState:
    live = {i: held[r].live for i, r in enumerate(ranks) if held[r].live != NO_STATE}
    steps = set(live.values())
    if len(steps) != 1:
        return SiteState(NO_STATE)
    step = steps.pop()
    copies = {}
    for index in range(len(ranks)):
        if index in live:
            continue
        holders = [
            r
            for i, r in enumerate(ranks)
            if i in live and held[r].copy == (step, len(ranks), index)
        ]
        if not holders:
            return SiteState(NO_STATE)
        copies[index] = holders[0]
    return SiteState(step, copies)


def _outer_source(states: Sequence[SiteState], index: int, besides: int) -> bool:
    """Another site's rank of slice ``index`` kept its own outer state."""
    return any(
        s != besides and st.step != NO_STATE and index not in st.copies
        for s, st in enumerate(states)
    )
