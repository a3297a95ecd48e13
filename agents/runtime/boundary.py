"""The step boundary's vote: a few integers every rank agrees on before the next step.

Each rank fills a :class:`Proposal` from what it knows (the newest generation
its plan watcher saw, the control record, how long since the last periodic
save, whether etcd answers) and :func:`agree` all-reduces it with ``MAX``.
Every rank then acts on the same :class:`Agreement`, so planned changes
(drain, scale, checkpoint-now, stop, a periodic save by time) happen at the
same step on every rank, even when only one rank has heard of them yet.

The vote is not cast at every boundary.  A small all-reduce is mostly waiting
(for the slowest rank, for the wire): measured here, 1.6 ms a step over gloo
at a 10 ms step on 2 shared cores, more than everything else the boundary
does put together.  So every vote also agrees on how many steps pass before
the next one (:func:`steps_between_votes`: about :data:`VOTE_INTERVAL_S` of
training, the fewest any rank asks for), and the boundaries in between decide
only what needs no vote (a save due by step count).  Planned changes wait at
most one such interval; failures never wait for a vote (a failed collective
ends the step).

Whether a save is due is decided by the checkpoint library's one rule
(:meth:`checkpoint.SaveTrigger.decide`), fed with what the ranks agreed: the
controller's request counter and the clock of ``checkpoint.every_seconds``,
due when it is due on any rank.  The vote also says whether every rank's
asynchronous save has ended: only then does each take its outcome, so that the
ranks count a failed save at the same boundary.  :class:`StepBoundary` keeps a worker's place
in this schedule and turns an agreement into a :class:`Decision` that the
session carries out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from agents.state.sharded_timing import CollectiveTiming
    from checkpoint.triggers import SaveTrigger
    from orchestrator.state.records import ControlRecord

__all__ = [
    "MAX_STEPS_BETWEEN_VOTES",
    "SAVE_PERIODIC",
    "SAVE_REQUESTED",
    "SAVE_STOP",
    "VOTE_INTERVAL_S",
    "Agreement",
    "Decision",
    "Proposal",
    "StepBoundary",
    "agree",
    "steps_between_votes",
]

# Indices of the vector all-reduced (MAX) at a voting step boundary.
_GENERATION, _CHECKPOINT, _SEEN, _STOP, _ETCD_LOST, _SAVE_DUE, _NEG_EVERY, _UNSETTLED, _LEN = range(
    9
)

#: Training time between two votes: a planned change (a checkpoint request, a
#: stop, a new generation, an etcd outage) takes effect within about this long.
#: The controller itself looks once every 0.2 s; a preemption notice gives 30 s.
VOTE_INTERVAL_S = 0.5
#: Most steps between two votes, however short the steps.
MAX_STEPS_BETWEEN_VOTES = 100


def steps_between_votes(step_seconds: float) -> int:
    """How many steps make up :data:`VOTE_INTERVAL_S` at ``step_seconds`` a step (1 or more)."""
    if step_seconds <= 0:
        return 1
    return max(1, min(MAX_STEPS_BETWEEN_VOTES, int(VOTE_INTERVAL_S / step_seconds)))


@dataclass(frozen=True)
class Proposal:
    """What one rank knows at a step boundary."""

    #: newest generation this rank's plan watcher has seen
    generation: int
    #: checkpoint requests the controller has made so far (a counter)
    checkpoint_requested: int
    #: checkpoint requests this rank has served
    checkpoint_served: int
    #: the controller asks the job to stop
    stop: bool
    #: this rank has not heard from etcd for longer than it may
    etcd_lost: bool
    #: ``checkpoint.every_seconds`` have passed since this rank's last periodic save
    save_due_by_time: bool
    #: steps this rank would train before the next vote (:func:`steps_between_votes`)
    every: int = 1
    #: this rank's asynchronous save is still uploading
    save_unsettled: bool = False

    def vector(self) -> tuple[int, ...]:
        """As the integers the vote all-reduces with MAX."""
        vec = [0] * _LEN
        vec[_GENERATION] = self.generation
        vec[_CHECKPOINT] = self.checkpoint_requested
        vec[_SEEN] = self.checkpoint_served
        vec[_STOP] = int(self.stop)
        vec[_ETCD_LOST] = int(self.etcd_lost)
        vec[_SAVE_DUE] = int(self.save_due_by_time)
        vec[_NEG_EVERY] = -max(1, self.every)  # MAX of the negatives: the fewest steps
        vec[_UNSETTLED] = int(self.save_unsettled)
        return tuple(vec)


@dataclass(frozen=True)
class Agreement:
    """What every rank decides at the boundary (the MAX over all proposals)."""

    generation: int
    checkpoint_requested: int
    checkpoint_served: int
    stop: bool
    etcd_lost: bool
    save_due_by_time: bool
    #: steps until the next vote: the fewest any rank asked for
    every: int = 1
    #: some rank's asynchronous save is still uploading
    save_unsettled: bool = False

    @classmethod
    def quiet(cls, generation: int, served: int) -> Agreement:
        """What a boundary without a vote decides: no request, no stop, no outage, and
        no save outcome taken (no rank knows whether the others' saves ended)."""
        return cls(generation, served, served, False, False, False, save_unsettled=True)

    @classmethod
    def of_vector(cls, vec: Sequence[int]) -> Agreement:
        """The agreement a vector of :meth:`Proposal.vector`'s form holds (its MAX)."""
        return cls(
            generation=int(vec[_GENERATION]),
            checkpoint_requested=int(vec[_CHECKPOINT]),
            checkpoint_served=int(vec[_SEEN]),
            stop=bool(vec[_STOP]),
            etcd_lost=bool(vec[_ETCD_LOST]),
            save_due_by_time=bool(vec[_SAVE_DUE]),
            every=-int(vec[_NEG_EVERY]),
            save_unsettled=bool(vec[_UNSETTLED]),
        )

    def vector(self) -> tuple[int, ...]:
        """This agreement as integers whose element-wise MAX with another's agrees both."""
        return Proposal(
            self.generation,
            self.checkpoint_requested,
            self.checkpoint_served,
            self.stop,
            self.etcd_lost,
            self.save_due_by_time,
            self.every,
            self.save_unsettled,
        ).vector()

    @property
    def checkpoint_request_new(self) -> bool:
        """A request no rank has served yet (a replacement has seen none, its peers have)."""
        return self.checkpoint_requested > self.checkpoint_served


def agree(
    mine: Proposal,
    group: dist.ProcessGroup | None = None,
    timing: CollectiveTiming | None = None,
) -> Agreement:
    """All-reduce ``mine`` with every rank's (a collective: every rank calls it).

    ``group`` is the generation's gloo control group under NCCL, so the
    boundary never waits on the GPU stream (None: the default group).  The
    all-reduce waits for the slowest rank to reach the boundary: with
    ``timing`` (the worker's step timing) that wait is counted as one, not as
    compute (a rank slow after its last gradient bucket, in its optimizer step
    say, is waited for here, and untimed its peers would look as slow as it).
    """
    vec = torch.tensor(mine.vector(), dtype=torch.int64)
    started = timing.collective_started() if timing is not None else None
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    if timing is not None:
        timing.collective_ended(started)
    return Agreement.of_vector(vec.tolist())


#: Why the runtime saves (the ``reason`` an ``on_save`` callback and a checkpoint record get).
SAVE_REQUESTED, SAVE_PERIODIC, SAVE_STOP = "requested", "periodic", "stop"


@dataclass(frozen=True)
class Decision:
    """What a step boundary decided, the same on every rank; the session carries it out."""

    #: the newest generation some rank knows of (newer than the current: leave for it)
    generation: int
    #: saves to make now, in order (``requested``, ``periodic``, ``stop``)
    saves: tuple[str, ...]
    #: the controller asks the job to stop (after the saves)
    stop: bool
    #: etcd is away for some rank: pause until it is back
    pause: bool
    #: the controller's checkpoint requests served once the saves are made
    served: int
    #: every rank's asynchronous save has ended: each takes its outcome now, so that
    #: all count a failed save at the same boundary (and rank 0, which reports them,
    #: reports each before a rank fails the job for it)
    settle: bool = False


class StepBoundary:
    """One worker's vote schedule and the control requests it served.

    The first boundary of every generation votes (:meth:`joined`); each vote
    agrees on how many steps pass before the next.  Under a delayed sync each
    site votes inside itself (``sites``), and what must happen at one step on
    every site (the saves, the stop, taking the saves' outcomes) is agreed in
    the outer syncs' rounds instead (:mod:`agents.sync.rounds`): a site never
    waits for another between outer syncs.
    """

    def __init__(self) -> None:
        self._vote_at = 0
        self._served = 0
        #: a delayed sync's sites: votes are the site's own; saves and stops come
        #: from the rounds' agreements (``across`` of :meth:`decide`)
        self.sites = False

    def joined(self) -> None:
        """A generation was joined: its first boundary votes, on every rank."""
        self._vote_at = 0

    def votes_at(self, step: int) -> bool:
        """The boundary after ``step`` casts a vote."""
        return step >= self._vote_at

    def propose(
        self,
        *,
        generation: int,
        control: ControlRecord,
        etcd_lost: bool,
        time_due: bool,
        step_seconds: float,
        save_unsettled: bool = False,
    ) -> Proposal:
        """This rank's proposal from what it knows (see :class:`Proposal`)."""
        return Proposal(
            generation=generation,
            checkpoint_requested=control.checkpoint,
            checkpoint_served=self._served,
            stop=control.stop,
            etcd_lost=etcd_lost,
            save_due_by_time=time_due,
            every=steps_between_votes(step_seconds),
            save_unsettled=save_unsettled,
        )

    def decide(
        self,
        step: int,
        generation: int,
        agreed: Agreement | None,
        schedule: SaveTrigger,
        across: Agreement | None = None,
    ) -> Decision:
        """What the boundary after ``step`` does.

        Args:
            step: the step just completed.
            generation: the worker's current generation.
            agreed: the vote's outcome; None at a boundary without a vote (no
                request, no stop, no outage, no save by time).
            schedule: the periodic save rule and its clock (``checkpoint.every_*``).
            across: under a delayed sync (:attr:`sites`), what the sites agreed in
                the outer syncs that finished at this boundary (None: none did):
                the saves and the stop come from it alone, the site's own vote
                gives the generation and the pause.
        """
        if agreed is None:
            agreed = Agreement.quiet(generation, self._served)
        else:
            self._vote_at = step + agreed.every
        if self.sites:
            controls = across if across is not None else Agreement.quiet(generation, self._served)
            agreed = replace(
                controls,
                generation=max(agreed.generation, controls.generation),
                etcd_lost=agreed.etcd_lost,
            )
        # Every rank decides from the same reduced numbers (a replacement has seen
        # no request yet, its peers have): a request is new only if no rank served it.
        due = schedule.decide(
            step,
            requested=SAVE_REQUESTED if agreed.checkpoint_request_new else None,
            time_due=agreed.save_due_by_time,
        )
        saves = [] if due is None else [SAVE_REQUESTED if due.requested else SAVE_PERIODIC]
        if agreed.stop:
            saves.append(SAVE_STOP)
        return Decision(
            generation=agreed.generation,
            saves=tuple(saves),
            stop=agreed.stop,
            pause=agreed.etcd_lost,
            served=max(agreed.checkpoint_requested, agreed.checkpoint_served),
            settle=not agreed.save_unsettled,
        )

    def served(self, decision: Decision) -> None:
        """``decision``'s saves were made: its requests count as served.

        Not before: a save that breaks with the group (a peer left, e.g. the
        first of several preempted nodes) is asked again in the next generation.
        """
        self._served = decision.served
