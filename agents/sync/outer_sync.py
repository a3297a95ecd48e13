"""DiLoCo's outer loop in one worker: its tracked state and its syncs between sites.

Runs in the training process.  :class:`OuterSync` is tracked state like a
model or an optimizer (the session tracks it as ``outer``): the anchors (the
sites' common parameters after the last outer step, one flat float32 vector
per fragment, in host memory also on a GPU worker), the outer optimizer's
momentum, how many outer steps each fragment took, and the syncs that started
but whose result is not used yet (with a delay).  A replacement receives it
from a live peer of its site; it goes into durable checkpoints.

At each step boundary (:meth:`OuterSync.after_step`) a fragment whose sync is
due computes its pseudo-gradient; the site's leader offers it to the
fragment's round (:mod:`agents.sync.round_exchange`, encoded as
``SyncSpec.quantization`` says, weighted by the site's ranks) and, once the
result is due, averages the contributions of the sites the round was decided
with (``sync.quorum``), hands the average to its site's ranks (a broadcast on
the site's group), and every rank takes the outer step and merges its result
with its own fragment (``SyncSpec.mixing``); a site left out of the round
keeps its own steps instead (:func:`~agents.sync.outer_step.rebase`).  With a
delay the round runs while the next inner steps compute.  Each fragment has
its own momentum and count.  What the sites agreed in a round (its saves, a
stop) waits in :attr:`OuterSync.agreed` for the runtime.  The module is over
450 lines because that state and what the boundary and a join do to it are
one object's: the rules of a round and its I/O are in modules of their own
(:mod:`agents.sync.rounds`, :mod:`agents.sync.round_exchange`).

The last boundary of the run (:attr:`OuterSync.end`) waits for every sync still
under way, applies it, and leaves each fragment at its anchor: training ends
on the global model, the same on every site, as DiLoCo evaluates it (a
site's inner steps since a fragment's last sync are not kept).

Joining a generation (:func:`agents.recovery.site_join.join_sites`)
forms the sites' groups and brings each site to its own freshest state.

With an FSDP2 model in each site (``local`` given) the outer state stands for
this rank's slice only: the fragments are cut by the whole parameters (the
same fragments as a DDP model's), each holds the local rows of its
parameters, and every rank syncs its slice with the same-index ranks of the
other sites (:mod:`agents.recovery.site_shards`).  Such a state is this rank's
own (:attr:`OuterSync.rank_local`), not the site's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from agents.sync.outer_step import (
    OuterOptimizer,
    average,
    flatten,
    merge_into,
    pseudo_gradient,
    rebase,
    write_back,
)
from agents.sync.quantize import decode, empty_like_payload, encode
from agents.sync.round_exchange import RoundExchange, RoundPlace
from agents.sync.round_media import RoundMedium, RoundsInStore, generation_store
from agents.sync.rounds import Offer
from agents.sync.schedule import FragmentSchedule, cut_fragments
from agents.sync.site_groups import SiteGroups
from orchestrator.spec.sync import SyncSpec

__all__ = ["NOT_PENDING", "OuterSync", "SyncTotals", "per_slice"]

log = logging.getLogger("ringmaster.worker")

#: ``pending_at`` of a fragment with no sync under way.
NOT_PENDING = -1


@dataclass
class SyncTotals:
    """What this worker's outer loop did (its telemetry)."""

    #: bytes this site's leader received from other sites' leaders
    bytes_between_sites: int = 0
    #: seconds spent waiting in outer syncs (not overlapped with inner steps)
    outer_wait_s: float = 0.0
    #: steps complete at each fragment's last applied sync
    last_sync: list[int] = field(default_factory=list)
    #: outer steps this site took without its own pseudo-gradient in them: it reached
    #: the round after the others went ahead (``sync.quorum``)
    left_out: int = 0


class OuterSync:
    """The outer loop of one worker (see the module docstring).

    Args:
        spec: the job's ``sync`` section (``diloco`` or ``streaming_diloco``).
        params: the model's parameters, in model order (every rank the same model).
        local: a sharded model's: this rank's local rows of each of ``params`` now, in
            the same order (they change with each generation's layout).
    """

    def __init__(
        self,
        spec: SyncSpec,
        params: Sequence[torch.Tensor],
        local: Callable[[], Sequence[torch.Tensor]] | None = None,
    ) -> None:
        self.spec = spec
        self.schedule = FragmentSchedule(spec.inner_steps, spec.fragments, spec.delay_steps)
        self._optimizer = OuterOptimizer.of_spec(spec.outer_optimizer)
        runs = cut_fragments([p.numel() for p in params], spec.fragments)
        self._runs = runs
        fixed = list(params)
        self._local = local if local is not None else (lambda: fixed)
        #: this rank's own state (a slice's), not its site's: left out of a sharded
        #: model's replicated state (:func:`agents.state.tracked_optimizers.others_of`)
        self.rank_local = local is not None
        self.anchors = [flatten(f) for f in self._fragments]
        self.momentum = [torch.zeros_like(a) for a in self.anchors]
        self.counts = [0] * len(runs)
        #: steps complete at the last boundary whose due syncs were started
        self.started = 0
        self.pending_at = [NOT_PENDING] * len(runs)
        self.pending_delta = [torch.zeros_like(a) for a in self.anchors]
        self.pending_weight = [0.0] * len(runs)
        self._rounds: dict[int, RoundExchange] = {}  # on a carrier: the rounds under way
        self._votes: dict[int, tuple[int, ...]] = {}  # each round's site vote, at its start
        #: the site's step-boundary vote as integers (set by the runtime): called on every
        #: rank of a site at each round's start, a collective inside the site
        self.site_vote: Callable[[], tuple[int, ...]] = lambda: ()
        #: where the rounds keep their records and bytes (set by the runtime for each
        #: generation: etcd and each carrier's own store); None: the generation's store
        self.rounds: RoundMedium | None = None
        #: a newer generation is published (set by the runtime): a waiting round gives up
        self.moved_on: Callable[[], bool] = lambda: False
        #: seconds a round may wait for its quorum, as the outer syncs taught (set by
        #: the runtime), and at most (a fragment's last round waits for every site)
        self.wait_limit: Callable[[], float] = lambda: 2 * 3600.0
        self.longest_wait: Callable[[], float] = lambda: 2 * 3600.0
        #: steps complete -> what the sites agreed in the rounds finished at that boundary
        #: (the runtime takes it: the saves and the stop every site makes there)
        self.agreed: dict[int, tuple[int, ...]] = {}
        #: fragment -> (anchor, momentum) after the outer step of its pending sync, as
        #: another site applied it while this site's generation broke (see site_join)
        self.resolved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.groups: SiteGroups | None = None
        #: boundaries up to this step count skip the step boundary's vote: this site
        #: trains steps the others completed before the generation broke
        self.catch_up_to = 0
        #: the steps complete at the end of training (the session's ``steps()`` limit),
        #: if it has one: that boundary finishes every sync under way and leaves each
        #: fragment at its anchor, the global model (the same on every site)
        self.end: int | None = None
        self.totals = SyncTotals(last_sync=[0] * len(runs))
        #: a sharded model's: the sites a durable checkpoint's outer state of this slice
        #: was saved on (set by a restore; None: it held none)
        self.saved_sites: list[list[int]] | None = None
        #: that outer state (``sites``, ``state``) when its sites are not this generation's
        #: (:mod:`agents.recovery.outer_reshard` cuts it to the new slices)
        self.saved_piece: dict[str, Any] | None = None
        self._began = [0.0] * len(runs)  # when each fragment's sync under way started here
        self._blank_through = -1  # syncs that start up to here weigh 0 (start_from_anchors)
        self._took: list[float] = []

    @property
    def fragments(self) -> int:
        return len(self._runs)

    @property
    def runs(self) -> list[list[int]]:
        """The parameters (indices into ``params``) of each fragment."""
        return [list(r) for r in self._runs]

    @property
    def _fragments(self) -> list[list[torch.Tensor]]:
        params = self._local()
        return [[params[i] for i in run] for run in self._runs]

    def fit(self) -> None:
        """Size the outer state to the parameters it stands for now (a sharded model's
        slice changes with the layout): a fragment of another size starts again from
        the parameters, without momentum or a sync under way."""
        for f, frag in enumerate(self._fragments):
            numel = sum(p.numel() for p in frag)
            if self.anchors[f].numel() != numel:
                self.anchors[f] = flatten(frag)
                self.momentum[f] = torch.zeros_like(self.anchors[f])
                self.pending_delta[f] = torch.zeros_like(self.anchors[f])
                self.pending_at[f] = NOT_PENDING
                self.pending_weight[f] = 0.0

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The parameters the anchors stand for, fragment after fragment."""
        return [p for fragment in self._fragments for p in fragment]

    def not_for_a_new_site(self) -> list[torch.Tensor]:
        """The outer state's tensors a site without state is not sent
        (:func:`agents.recovery.site_join.join_sites`): every pseudo-gradient kept (such a
        site starts from the anchors, so it has moved nothing since any sync under way
        started: :meth:`start_from_anchors` zeroes its own), and the momentum of an
        outer step without momentum (never read)."""
        unused = [] if self._optimizer.momentum else list(self.momentum)
        return [*self.pending_delta, *unused]

    def start_from_anchors(self, done: int) -> None:
        """A site without state starts from the sites' common parameters at ``done``
        steps: its parameters become the anchors, and it contributes nothing to the
        syncs under way nor to one that starts at ``done`` itself (it trained none of
        their steps: its pseudo-gradients are zero, their weights 0)."""
        for f in range(self.fragments):
            self.take_anchor(f)
            self.pending_delta[f].zero_()
        self.pending_weight = [0.0] * self.fragments
        self._blank_through = done

    def take_from_another_site(self, state: dict[str, Any], done: int) -> None:
        """Load the outer state of the same slice from another site (this rank's slice
        came from a buddy's copy in its site, at ``done`` steps): the anchors, momentum
        and counts are the sites' common values; this site's own pseudo-gradients of
        the syncs under way are not in it, so they count with weight 0 (what the slice
        moved is in its parameters, merged with the result as every site's are)."""
        self.load_state_dict(state)
        for delta in self.pending_delta:
            delta.zero_()
        self.pending_weight = [0.0] * self.fragments
        self.started = done

    def anchor_to_parameters(self, done: int) -> None:
        """Take the parameters now as the anchors (the sites' common value), at ``done``
        steps: the next syncs' pseudo-gradients count from here."""
        self.anchors = [flatten(f) for f in self._fragments]
        self.started = done

    # -- tracked state -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "anchors": list(self.anchors),
            "momentum": list(self.momentum),
            "counts": list(self.counts),
            "started": self.started,
            "pending_at": list(self.pending_at),
            "pending_delta": list(self.pending_delta),
            "pending_weight": list(self.pending_weight),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a saved outer state (into host memory, wherever a restore put its
        tensors); one cut into another number of fragments is re-cut.

        Raises:
            ValueError: the state is of a model with another number of parameters.
        """
        anchors = [_host(t) for t in state["anchors"]]
        numel = sum(a.numel() for a in self.anchors)
        if sum(a.numel() for a in anchors) != numel:
            raise ValueError(
                f"the outer state holds {sum(a.numel() for a in anchors)} parameters, this "
                f"model has {numel}: it was saved from another model; resume with the model "
                "it was saved from, or from another checkpoint root (checkpoint.url)"
            )
        self.started = int(state["started"])
        if len(anchors) == len(self.anchors) and all(
            a.numel() == b.numel() for a, b in zip(anchors, self.anchors, strict=True)
        ):
            self.anchors = [a.clone() for a in anchors]
            self.momentum = [_host(t).clone() for t in state["momentum"]]
            self.counts = [int(c) for c in state["counts"]]
            self.pending_at = [int(c) for c in state["pending_at"]]
            self.pending_delta = [_host(t).clone() for t in state["pending_delta"]]
            self.pending_weight = [float(w) for w in state["pending_weight"]]
            return
        # another sync.fragments: the fragments are contiguous runs of the same order
        sizes = [a.numel() for a in self.anchors]
        self.anchors = [a.clone() for a in torch.cat(anchors).split(sizes)]
        momentum = torch.cat([_host(t) for t in state["momentum"]])
        self.momentum = [m.clone() for m in momentum.split(sizes)]
        self.counts = [max(int(c) for c in state["counts"])] * len(sizes)
        dropped = sum(1 for at in state["pending_at"] if int(at) != NOT_PENDING)
        if dropped:
            log.warning("%d outer sync(s) under way dropped: sync.fragments changed", dropped)
        self.pending_at = [NOT_PENDING] * len(sizes)
        self.pending_weight = [0.0] * len(sizes)

    # -- the boundary ------------------------------------------------------------------

    def after_step(self, done: int) -> None:
        """The boundary with ``done`` steps complete: start and finish the syncs due."""
        for at, f in self.schedule.starts_between(self.started, done):
            if self.pending_at[f] == NOT_PENDING:
                self._start(f, at)
        self.started = max(self.started, done)
        for f in sorted(range(self.fragments), key=lambda i: self.pending_at[i]):
            if self._due(self.pending_at[f], done):
                self._finish(f, done)
        if self._is_last(done):  # the run ends on the global model, not on a site's inner steps
            for f in range(self.fragments):
                self.take_anchor(f)

    def waits_at(self, done: int) -> bool:
        """The boundary with ``done`` steps complete waits for an outer result (a sync
        finishes there): the site's ranks wait in its broadcast while their leader
        waits for the other sites.  The same rule as :meth:`after_step`'s."""
        starting = self.schedule.starts_between(self.started, done)
        if starting and (self.schedule.delay_steps == 0 or self._is_last(done)):
            return True  # a sync that starts here finishes here too
        return any(self._due(at, done) for at in self.pending_at)

    def _pending(self) -> bool:
        """A sync is under way (started, its result not used yet)."""
        return any(at != NOT_PENDING for at in self.pending_at)

    def _is_last(self, done: int) -> bool:
        return self.end is not None and done >= self.end

    def _due(self, at: int, done: int) -> bool:
        """A sync started at ``at`` finishes at ``done``: its delay has run out, or the
        run ends there (the last boundary waits for every sync under way)."""
        return at != NOT_PENDING and (at + self.schedule.delay_steps <= done or self._is_last(done))

    def meets(self, done: int) -> bool:
        """The sites meet at the boundary with ``done`` steps complete (a sync starts)."""
        return self.schedule.starts_at(done) is not None

    def resume(self, done: int) -> None:
        """In a new generation at ``done`` steps: start again, in the order they first
        started, the syncs a broken generation left under way, and finish those due.

        An outer state that never synced while the model is at ``done`` > 0 was not
        restored with it (a checkpoint saved under ``sync.mode: ddp``, or weights the
        script loaded itself): its anchors are the parameters at ``wrap()``, so they
        are taken from the parameters now instead (every site restored the same).
        """
        if done > self.started == 0 and not any(self.counts) and not self._pending():
            log.warning(
                "no outer state came with the model at step %d (a checkpoint saved under "
                "sync.mode ddp?): the sites' anchors start from the parameters now",
                done,
            )
            self.anchor_to_parameters(done)
        for f in sorted(range(self.fragments), key=lambda i: self.pending_at[i]):
            if self.pending_at[f] == NOT_PENDING:
                continue
            if f in self.resolved:  # its outer step went through on another site: no
                self._votes[f] = self.site_vote()  # round, but the site's vote all the same
            else:  # (each of a site's ranks votes for every sync under way)
                self._began[f] = time.perf_counter()
                self._exchange(f)
        self.after_step(done)

    def took(self) -> list[float]:
        """The seconds from start to use of each sync finished here since the last call
        (one whose result came from another site's generation is left out): what the
        timeout between sites is learnt from."""
        took, self._took = self._took, []
        return took

    def _start(self, f: int, at: int) -> None:
        self._began[f] = time.perf_counter()
        self.pending_delta[f] = pseudo_gradient(self.anchors[f], self._fragments[f])
        self.pending_weight[f] = 0.0 if at <= self._blank_through else 1.0
        self.pending_at[f] = at
        self._exchange(f)

    def _exchange(self, f: int) -> None:
        """Every rank of the site votes; its carrier (the leader, or each rank of an FSDP2
        site) offers fragment ``f``'s pseudo-gradient to the round in the background
        (:mod:`agents.sync.round_exchange`)."""
        groups = self._need_groups()
        self._votes[f] = self.site_vote()
        if not (groups.is_leader or groups.per_slice):
            return
        kind, numel = self.spec.quantization, self.pending_delta[f].numel()
        mine = groups.sites.ranks[groups.index]
        place = RoundPlace(
            fragment=f,
            at=self.pending_at[f],
            site=groups.index,
            sites=len(groups.sites),
            carriers=len(mine) if groups.per_slice else 1,
            slot=mine.index(groups.rank) if groups.per_slice else 0,
        )
        # a site counts by its tokens: every rank takes the same batch, so by its ranks
        offer = Offer(self.pending_weight[f] * len(mine), self._votes[f], parts=0)
        quorum = self.spec.quorum if self.spec.quorum is not None else len(groups.sites)
        if self._final(self.pending_at[f]):  # the run ends on every site's last steps
            quorum = len(groups.sites)
        self._rounds[f] = RoundExchange(
            self.rounds or RoundsInStore(generation_store()),
            place,
            encode(self.pending_delta[f], kind),
            lambda: empty_like_payload(numel, kind),
            offer,
            quorum,
            self.spec.sync_timeout,
        )

    def _finish(self, f: int, done: int) -> None:
        """Wait for fragment ``f``'s sync, share the average, take the outer step, merge."""
        left_out = False
        if f in self.resolved:  # its outer step went through on another site
            self.anchors[f], self.momentum[f] = self.resolved.pop(f)
            self._votes.pop(f, None)
        else:
            avg, left_out, agreed = self._average(f)
            if agreed:  # fragments finishing at one boundary: what any round agreed
                seen = self.agreed.get(done, ())
                self.agreed[done] = tuple(
                    max(a, b) for a, b in zip(agreed, seen or agreed, strict=True)
                )
            if avg is None:  # every site that contributed is gone
                log.warning(
                    "fragment %d: no site that contributed to the sync started at step %d "
                    "is here any more: no outer step",
                    f,
                    self.pending_at[f],
                )
                self.pending_at[f] = NOT_PENDING
                self.pending_weight[f] = 0.0
                return
            before = self.anchors[f].clone() if left_out else None
            self._optimizer.step(self.anchors[f], self.momentum[f], avg)
            if self._began[f]:
                self._took.append(time.perf_counter() - self._began[f])
            if before is not None:  # its own steps are not in the outer step: it keeps them
                rebase(self._fragments[f], before, self.anchors[f])
                self.totals.left_out += 1
        if not left_out:
            merge_into(self._fragments[f], self.anchors[f], self.spec.mixing)
        self.counts[f] += 1
        self.pending_at[f] = NOT_PENDING
        self.pending_weight[f] = 0.0
        self.totals.last_sync[f] = done

    def _average(self, f: int) -> tuple[torch.Tensor | None, bool, tuple[int, ...]]:
        """Fragment ``f``'s round, on every rank of the site: the weighted average of the
        pseudo-gradients that take part (None where none has a weight: every site that
        did joined after the round started), whether this site was left out of it, and
        what the sites agreed."""
        groups = self._need_groups()
        waited = time.perf_counter()
        numel = self.anchors[f].numel()
        avg: torch.Tensor | None = None
        left_out = False
        agreed = self._votes.pop(f, ())
        if groups.is_leader or groups.per_slice:
            at = self.pending_at[f]
            limit = self.longest_wait() if self._final(at) else self.wait_limit() + self.grace_s
            result = self._rounds.pop(f).wait(self.moved_on, limit)
            kind = self.spec.quantization
            if result.received:
                avg = average([(w, decode(p, kind, numel)) for w, p in result.received])
            left_out = not result.decision.takes_part(groups.index)
            agreed = result.decision.agreement
            self.totals.bytes_between_sites += result.bytes_read
        if len(groups.sites.ranks[groups.index]) > 1 and not groups.per_slice:  # the site's
            # the last two values: whether there is an average (1) or none (0), and
            # whether this site was left out of the round
            shared = torch.zeros(numel + 2, dtype=torch.float32, device=groups.device)
            votes = torch.tensor(agreed, dtype=torch.int64)  # on gloo: host memory
            if avg is not None:
                shared[:numel].copy_(avg)
                shared[numel] = 1.0
            shared[numel + 1] = float(left_out)
            dist.broadcast(shared, src=groups.leader, group=groups.inner)
            if votes.numel():
                dist.broadcast(votes, src=groups.leader, group=groups.inner_host)
            host = shared.cpu()
            avg = host[:numel] if bool(host[numel]) else None
            left_out = bool(host[numel + 1])
            agreed = tuple(int(v) for v in votes.cpu())
        self.totals.outer_wait_s += time.perf_counter() - waited
        return avg, left_out, agreed

    @property
    def grace_s(self) -> float:
        """Seconds a round may wait beyond what the outer syncs taught: ``sync_timeout``
        under a quorum (the others are waited for that long before it goes ahead)."""
        return self.spec.sync_timeout.total_seconds() if self.spec.quorum is not None else 0.0

    def waits_for_all(self, done: int) -> bool:
        """The boundary with ``done`` steps complete waits in a fragment's last round of
        the run, for every site (see :meth:`_final`)."""
        starting = [at for at, _ in self.schedule.starts_between(self.started, done)]
        finishing = [at for at in self.pending_at if self._due(at, done)]
        now = starting if self.schedule.delay_steps == 0 or self._is_last(done) else []
        return any(self._final(at) for at in [*now, *finishing])

    def _final(self, at: int) -> bool:
        """A round started at ``at`` is its fragment's last of the run: it waits for every
        site, whatever ``sync.quorum`` (a site behind finishes the run in it, rather than
        be stopped once the others are done, its last steps in no outer step)."""
        return self.end is not None and at + self.schedule.inner_steps > self.end

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (the outer state itself is in host memory)."""
        return self._fragments[0][0].device

    def _need_groups(self) -> SiteGroups:
        if self.groups is None:
            raise RuntimeError("the outer sync runs inside a generation (no site groups yet)")
        return self.groups

    # -- generations -------------------------------------------------------------------

    def drop(self) -> None:
        """Forget the broken generation's groups and the syncs in flight on them."""
        for round_ in self._rounds.values():
            round_.cancel()
        self._rounds.clear()
        self._votes.clear()
        self.agreed.clear()
        self._blank_through = -1
        self.resolved.clear()
        self.groups = None
        self._took.clear()  # a new generation learns from its own syncs

    def take_anchor(self, f: int) -> None:
        """Set fragment ``f``'s parameters to its anchor (the sites' common value)."""
        write_back(self._fragments[f], self.anchors[f])


def per_slice(obj: object) -> bool:
    """``obj`` is an outer state of one rank's slice (a sharded model's), not its site's."""
    return isinstance(obj, OuterSync) and obj.rank_local


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32 in host memory (itself when it is already)."""
    return t.detach().to("cpu", torch.float32)
