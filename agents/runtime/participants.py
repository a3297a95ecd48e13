"""What takes part in the step loop beside the script's step: the session's participants.

Runs in the training process.  After each step the session (:mod:`agents.runtime.session`)
calls every participant that the script's wrap made, in the order made, through
one contract (:class:`StepParticipant`): at the step boundary, when a
generation is joined, and when the group goes.  It names none of them.  Two
kinds exist:

* :class:`DelayedSync`: a delayed sync's outer loop (:class:`~agents.sync.outer_sync.OuterSync`,
  ``sync.mode`` diloco or streaming_diloco): its outer steps when due, the
  boundaries where the sites may vote, the steps a site catches up without a
  vote, the groups it forms in each generation, its figures;
* :class:`BuddySnapshots`: a sharded model's buddy copies
  (:class:`~agents.state.buddy_copies.BuddyCopies`): a snapshot when one is
  due, an exchange to stop before the group goes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agents.api import Stateful
from agents.runtime.failures import CollectiveFailures
from agents.runtime.outer_checkpoint import OUTER_STATE
from agents.state.buddy_copies import BuddyCopies
from agents.state.sharding import ShardedModel
from agents.state.tracked_optimizers import optimizers_of, others_of
from agents.sync.outer_sync import OuterSync
from agents.sync.round_media import RoundMedium

__all__ = ["BuddySnapshots", "DelayedSync", "Lent", "StepParticipant"]


@dataclass(frozen=True)
class Lent:
    """What the session lends its participants (:meth:`StepParticipant.lend`).

    Attributes:
        vote: the step boundary's vote in a group, as integers.
        moved_on: a newer generation is published.
        wait_limit: seconds a wait between sites may take, as the outer syncs taught.
        longest_wait: seconds a wait between sites may take at most.
        rounds: where the generation's outer syncs keep their records and bytes.
    """

    vote: Callable[[dist.ProcessGroup], tuple[int, ...]]
    moved_on: Callable[[], bool]
    wait_limit: Callable[[], float]
    longest_wait: Callable[[], float]
    rounds: RoundMedium


class StepParticipant:
    """One part of the step loop; this base takes part in nothing (a participant
    overrides what it does).  ``step`` is always the number of steps completed."""

    #: its sites agree on the saves and the stop in rounds of their own, and each
    #: votes inside itself between them (see :class:`agents.runtime.boundary.StepBoundary`)
    across_sites = False

    def lend(self, lent: Lent) -> None:
        """The session's vote, its word of a newer generation, and its timeouts between
        sites (lent before each generation is joined)."""

    def vote_group(self) -> dist.ProcessGroup | None:
        """The group the step boundary votes in (None: the generation's control group)."""
        return None

    def agreed(self, step: int) -> tuple[int, ...] | None:
        """What its sites agreed for the boundary after ``step`` (a vote's integers;
        None: nothing there)."""
        return None

    def tracked(self) -> Mapping[str, Stateful]:
        """State of its own that goes with the tracked objects (into durable
        checkpoints, to a replacement), by the name it is tracked under."""
        return {}

    def ends_at(self, limit: int) -> None:
        """The loop ends once ``limit`` steps are complete."""

    def joined(self, step: int | None) -> None:
        """A generation was joined and its DDPs rebuilt (``step``: the state this
        worker holds; None: none).  A collective of the new generation."""

    def step_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Groups formed in the generation whose collectives run once a step or more
        (the learnt operation timeout applies to them)."""
        return ()

    def waits_at(self, step: int) -> bool:
        """:meth:`after_step` at ``step`` waits on a slow group (longer than a step)."""
        return False

    def grace_s(self, step: int) -> float:
        """Seconds such a wait at the boundary after ``step`` may take beyond what the
        slow waits taught."""
        return 0.0

    def after_step(self, step: int, tracked: Mapping[str, Any]) -> None:
        """Its work at the boundary after ``step`` (``tracked``: the worker's objects)."""

    def took(self) -> list[float]:
        """Seconds each slow wait that finished since the last call took."""
        return []

    def behind(self, step: int) -> bool:
        """``step`` was completed elsewhere already: the boundary casts no vote."""
        return False

    def newest_generation(self, latest: int) -> int | None:
        """At a boundary without a vote: the newest generation it knows of (``latest``:
        this rank's; a collective where it takes one), or None: no word."""
        return None

    def telemetry(self) -> Mapping[str, Any]:
        """Fields of the worker's telemetry record it measures."""
        return {}

    def stop(self) -> None:
        """Stop its work on the group (the group is about to go; it may wait on a peer)."""


class DelayedSync(StepParticipant):
    """A delayed sync's outer loop in the step loop.

    Args:
        outer: the outer loop (its site groups are formed by each join).
        failures: records a failure of its collectives as a peer's.
    """

    across_sites = True

    def __init__(self, outer: OuterSync, failures: CollectiveFailures) -> None:
        self.outer = outer
        self._failures = failures

    def lend(self, lent: Lent) -> None:
        outer = self.outer

        def site_vote() -> tuple[int, ...]:
            groups = outer.groups
            assert groups is not None, "a round starts inside a generation"
            return lent.vote(groups.inner_host)

        outer.site_vote, outer.moved_on = site_vote, lent.moved_on
        outer.wait_limit, outer.longest_wait = lent.wait_limit, lent.longest_wait
        outer.rounds = lent.rounds

    def vote_group(self) -> dist.ProcessGroup | None:
        groups = self.outer.groups
        return groups.inner_host if groups is not None else None

    def agreed(self, step: int) -> tuple[int, ...] | None:
        agreed = self.outer.agreed
        for older in [s for s in agreed if s < step]:  # a boundary that did not ask
            del agreed[older]
        return agreed.pop(step, None)

    def tracked(self) -> Mapping[str, Stateful]:
        return {OUTER_STATE: self.outer}

    def ends_at(self, limit: int) -> None:
        self.outer.end = limit  # the last outer step lands on the global model

    def joined(self, step: int | None) -> None:
        if step is not None:  # the syncs the broken generation left under way start again
            with self._failures.collective():
                self.outer.resume(step)

    def step_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Its site groups: their collectives run every step (the site's DDP, the check
        of :meth:`newest_generation`).  The outer syncs' rounds go through no group of
        their own (:mod:`agents.sync.round_exchange`)."""
        groups = self.outer.groups
        if groups is None:
            return ()
        host = (groups.inner_host,) if groups.inner_host is not groups.inner else ()
        return (groups.inner, *host)

    def waits_at(self, step: int) -> bool:
        return self.outer.waits_at(step)

    def grace_s(self, step: int) -> float:
        if self.outer.waits_for_all(step):
            return self.outer.longest_wait()
        return self.outer.grace_s

    def after_step(self, step: int, tracked: Mapping[str, Any]) -> None:
        with self._failures.collective():
            self.outer.after_step(step)

    def took(self) -> list[float]:
        return self.outer.took()

    def behind(self, step: int) -> bool:
        return step <= self.outer.catch_up_to  # a site catching up trains alone

    def newest_generation(self, latest: int) -> int | None:
        """The newest generation a rank of this site has seen: a site leaves a
        generation that moved on at its next step, together (its DDP spans it),
        instead of training on to its next outer sync (a site waiting to come back
        would otherwise wait up to ``inner_steps`` steps, and then catch them up)."""
        groups = self.outer.groups
        if groups is None or len(groups.sites.ranks[groups.index]) == 1:
            return latest
        newest = torch.tensor([latest], dtype=torch.int64)
        with self._failures.collective():
            dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=groups.inner_host)
        return int(newest.item())

    def telemetry(self) -> Mapping[str, Any]:
        totals = self.outer.totals
        return {
            "outer_steps": sum(self.outer.counts),
            "site_bytes": totals.bytes_between_sites,
            "outer_wait_s": round(totals.outer_wait_s, 6),
            "last_outer_sync": max(totals.last_sync, default=0),
            "outer_left_out": totals.left_out,
        }


class BuddySnapshots(StepParticipant):
    """A sharded model's buddy copies in the step loop (``fsdp`` with redundancy).

    Args:
        buddies: the copies (started on each generation by the join).
        model: the sharded model whose slice they copy.
    """

    def __init__(self, buddies: BuddyCopies, model: ShardedModel) -> None:
        self.buddies = buddies
        self._model = model

    def after_step(self, step: int, tracked: Mapping[str, Any]) -> None:
        model = self._model
        self.buddies.after_step(
            step,
            lambda: model.capture(step, optimizers_of(tracked), others_of(tracked, model)),
        )

    def stop(self) -> None:
        self.buddies.stop()
