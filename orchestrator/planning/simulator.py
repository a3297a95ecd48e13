"""A discrete-event simulation of one job through weeks of failures, under one tier.

Faults arrive as a Poisson process per :class:`~orchestrator.planning.api.FailureSource`
(or from a fixed schedule of :class:`~orchestrator.planning.api.Fault` s), drawn
from ``random.Random(seed)``: the same seed gives every tier the same faults as
far as their pools allow (a fault that would land on a node under repair is
thinned away).  Between events the job's accounts move in closed form, so
the cost of a run is the number of faults, not the length of the month:

* while the job stops (detect, rendezvous, restore, the step in flight) every
  GPU of its size is lost to ``recovery``; below ``nodes.min`` to ``waiting``;
* while it trains on ``a`` of its ``N`` nodes, with the slowest straggler at
  ``s`` times a normal step and checkpoints blocking ``C`` seconds every ``T``,
  work accrues at ``a/N / s * T/(T+C)`` of the whole job; the rest is
  ``smaller``, ``stragglers`` and ``checkpoints``;
* a fault whose cost includes ``rework`` takes back the work since the last
  checkpoint.

Failed nodes come back after their repair time: as spares (ringmaster, and
torchrun given the same pool) once their workers are warm (``spare_warmup_s``:
a failure that finds no warm spare but one starting waits for it), or as their
replica group once it healed (torchft).  A scheduled fault may carry the cost it
had in a recorded run, which then replaces its tier's (a replay of that run).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.planning.api import (
    LOSS_CAUSES,
    Cost,
    FailureModel,
    Fault,
    FaultKind,
    JobShape,
    SimResult,
    TierModel,
)

__all__ = ["draw_faults", "simulate"]

_DAY = 86400.0


@dataclass(frozen=True)
class _Arrival:
    """A drawn fault, with the uniform numbers that decide where it lands."""

    fault: Fault
    node_kind: bool  # lands on a node (not every rank at once)
    thin: float  # kept when below (nodes up) / (nodes reserved)
    where: float  # on a spare when below spares / nodes up


def draw_faults(
    model: FailureModel, job: JobShape, horizon_s: float, seed: int, reserved: int
) -> list[_Arrival]:
    """Every fault of ``model`` over ``horizon_s`` for a job holding ``reserved`` nodes."""
    rng = random.Random(seed)
    rates: list[float] = []
    for s in model.sources:
        per_s = s.per_node_day / _DAY
        rates.append(per_s * (job.nodes if s.kind is FaultKind.SOFTWARE else reserved))
    total = sum(rates)
    if total <= 0:
        return []
    cumulative = list(itertools.accumulate(rates))
    out: list[_Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(total)
        if t >= horizon_s:
            return out
        source = model.sources[
            min(bisect.bisect_right(cumulative, rng.random() * total), len(rates) - 1)
        ]
        repair = rng.expovariate(1.0 / source.repair_s) if source.repair_s > 0 else 0.0
        duration = rng.expovariate(1.0 / source.duration_s) if source.duration_s > 0 else 0.0
        fault = Fault(t, source.kind, source.nodes, repair, source.slowdown, duration)
        if source.kind is FaultKind.STRAGGLER and not source.swappable:
            fault = Fault(t, source.kind, 0, repair, source.slowdown, duration)
        out.append(
            _Arrival(fault, source.kind is not FaultKind.SOFTWARE, rng.random(), rng.random())
        )


class _Run:
    """The state of one simulated job (see the module docstring)."""

    def __init__(self, job: JobShape, tier: TierModel, horizon_s: float) -> None:
        self.job, self.tier, self.horizon = job, tier, horizon_s
        self.n = job.nodes
        self.spares = job.spares if tier.uses_spares else 0
        self.reserved = self.n + self.spares
        # torchft trains on any number of replica groups, down to one: a job of one
        # size (nodes.min = nodes) is held to it only by the tiers with spares; an
        # elastic job's nodes.min holds for torchft too
        group = min(tier.drop_nodes, self.n)
        if tier.uses_spares:
            self.floor = job.floor
        else:
            self.floor = group if job.floor >= self.n else max(group, job.floor)
        self.active, self.pool, self.stranded = self.n, self.spares, 0
        # nodes back but still warming up: when each is warm (heap), and how many of the
        # earliest were already taken by a failure that waited for them
        self.warming: list[float] = []
        self.claimed = 0
        self.t, self.down_until, self.waiting = 0.0, 0.0, False
        self.work = self.since = self.seg = 0.0
        self.lost = dict.fromkeys(LOSS_CAUSES, 0.0)
        self.idle_node_s = 0.0
        self.exhaustions = 0
        self.faults: Counter[str] = Counter()
        self.stragglers: dict[int, tuple[float, float]] = {}  # id -> (slowdown, end)
        self.sizes: list[tuple[float, int]] = [(0.0, self.n)]
        self.events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()

    # -- time --------------------------------------------------------------------------

    def push(self, at: float, what: str, payload: object = None) -> None:
        heapq.heappush(self.events, (at, next(self._seq), what, payload))

    def advance(self, to: float) -> None:
        dt = to - self.t
        if dt <= 0:
            return
        self.idle_node_s += (self.pool + len(self.warming)) * dt
        if self.waiting:
            self.lost["waiting"] += dt
        else:
            down = max(0.0, min(to, self.down_until) - self.t)
            self.lost["recovery"] += down
            if dt - down > 0:
                self._train(dt - down)
        self.t = to

    def _train(self, up: float) -> None:
        share = self.active / self.n
        slow = max((s for s, _ in self.stragglers.values()), default=1.0)
        block, every = self.tier.checkpoint_block_s, self.job.checkpoint_every_s
        keep = every / (every + block) if block > 0 else 1.0
        rate = share / slow * keep
        self.work += up * rate
        self.lost["checkpoints"] += up * share / slow * (1.0 - keep)
        self.lost["stragglers"] += up * share * (1.0 - 1.0 / slow)
        self.lost["smaller"] += up * (1.0 - share)
        period = every + block
        self.seg += up
        if self.seg >= period:
            self.seg %= period
            self.since = self.seg * rate
        else:
            self.since += up * rate

    def mark(self) -> None:
        size = 0 if self.waiting or self.t < self.down_until else self.active
        if self.sizes[-1][1] != size:
            self.sizes.append((self.t, size))

    # -- what happens ------------------------------------------------------------------

    def stop(self, cost: Cost, wait_s: float = 0.0) -> None:
        """The whole job stops for ``cost`` after ``wait_s`` (a spare warming up), and
        loses the work since the checkpoint (``rework``) or what a run recorded."""
        stop = wait_s + cost.stop_s + (0.5 * self.job.step_s if cost.in_flight else 0.0)
        if cost.rework:
            self.work -= self.since
            self.lost["rework"] += self.since
            self.since = self.seg = 0.0
        if cost.rework_s > 0:
            again = min(cost.rework_s, self.work)
            self.work -= again
            self.lost["rework"] += again
        self.down_until = max(self.down_until, self.t + stop)
        self.push(self.down_until, "mark")

    def fault(self, arrival: _Arrival) -> None:
        f = arrival.fault
        up = self.active + self.pool + self.stranded + len(self.warming)
        if arrival.node_kind and arrival.thin >= up / max(1, self.reserved):
            return  # it would have struck a node already out
        if f.kind is FaultKind.SOFTWARE:
            self.faults[f.kind.value] += 1
            if not self.waiting:
                self.stop(f.cost or self.tier.costs[FaultKind.SOFTWARE])
            return
        if f.kind is FaultKind.STRAGGLER:
            self.straggler(f)
            return
        if f.nodes == 1 and self.pool and arrival.where < self.pool / max(1, up):
            self.pool -= 1  # an idle spare failed: the pool is smaller until it is back
            self.faults[f.kind.value] += 1
            self.push(self.t + f.repair_s, "back", 1)
            return
        lost = min(f.nodes, self.active)
        if lost == 0:
            return
        self.faults[f.kind.value] += 1
        self.active -= lost
        wait = 0.0
        if self.tier.uses_spares:
            self.push(self.t + f.repair_s, "back", lost)
            take = min(lost, self.pool)
            self.pool -= take
            self.active += take
            if take < lost:
                self.exhaustions += 1
                wait = self.wait_for_warming(lost - take)
            self.regroup()
        else:  # the failed nodes' replica groups leave until the nodes are back and healed
            group = min(self.tier.drop_nodes, self.n)
            dropped = min(self.active + lost, -(-lost // group) * group)
            self.stranded += dropped - lost
            self.active -= dropped - lost
            self.push(self.t + f.repair_s + self.tier.rejoin_s, "rejoin", (dropped, lost))
        if self.active < self.floor:
            self.waiting = True
        elif not self.waiting:
            self.stop(f.cost or self.tier.costs[f.kind], wait)
        self.mark()

    def wait_for_warming(self, short: int) -> float:
        """Take up to ``short`` spares still warming up into the job, the earliest first;
        the seconds until the last of them is warm (the job waits for it)."""
        wait = 0.0
        for _ in range(min(short, len(self.warming))):
            wait = max(wait, heapq.heappop(self.warming) - self.t)
            self.claimed += 1
            self.active += 1
        return wait

    def regroup(self) -> None:
        """Train on whole replicas only: the rest of a broken one waits as spares."""
        whole = self.active // self.job.replica_nodes * self.job.replica_nodes
        self.pool += self.active - whole
        self.active = whole

    def back(self, nodes: int) -> None:
        warmup = self.tier.spare_warmup_s if self.tier.uses_spares else 0.0
        if warmup <= 0:
            self.pool += nodes
            self.grow()
            return
        for _ in range(nodes):  # its workers start and import; a spare once warm
            heapq.heappush(self.warming, self.t + warmup)
            self.push(self.t + warmup, "warm")

    def warm(self, _: object) -> None:
        """A node started ``spare_warmup_s`` ago is warm: a spare, unless a failure that
        waited for it already took it (those are always the earliest)."""
        if self.claimed:
            self.claimed -= 1
            return
        heapq.heappop(self.warming)
        self.pool += 1
        self.grow()

    def rejoin(self, group: tuple[int, int]) -> None:
        """A replica group that dropped ``group[0]`` nodes, ``group[1]`` of them failed,
        trains again: its failed nodes are back and it healed from a live group."""
        dropped, failed = group
        self.stranded -= dropped - failed
        self.active = min(self.n, self.active + dropped)
        self.resume_if_enough()

    def grow(self) -> None:
        room = self.n - self.active
        take = min(room, self.pool) // self.job.replica_nodes * self.job.replica_nodes
        if take <= 0:
            return
        self.pool -= take
        self.active += take
        if not self.resume_if_enough() and not self.waiting and self.t >= self.down_until:
            self.stop(self.tier.grow)
        self.mark()

    def resume_if_enough(self) -> bool:
        """A job waiting below nodes.min starts again from its checkpoint once it can."""
        if not self.waiting or self.active < self.floor:
            return False
        self.waiting = False
        self.stop(self.tier.costs[FaultKind.SOFTWARE] if self.tier.uses_spares else Cost())
        self.mark()
        return True

    def straggler(self, f: Fault) -> None:
        if self.waiting or self.active == 0:
            return
        self.faults[f.kind.value] += 1
        key = next(self._seq)
        end = self.t + f.duration_s
        self.stragglers[key] = (f.slowdown, end)
        self.push(end, "straggler_end", key)
        swap_after = self.tier.straggler_swap_s
        if swap_after is not None and f.nodes > 0 and f.slowdown > 1.0:
            delay = swap_after + self.tier.straggler_confirm_s / (1.0 - 1.0 / f.slowdown)
            if delay < f.duration_s:
                self.push(self.t + delay, "straggler_swap", key)

    def straggler_swap(self, key: int) -> None:
        if key not in self.stragglers or self.pool == 0 or self.waiting:
            return
        _, end = self.stragglers.pop(key)
        self.pool -= 1  # the slow node is quarantined until its slow spell is over
        self.push(end, "back", 1)
        self.stop(self.tier.costs[FaultKind.STRAGGLER])

    def result(self) -> SimResult:
        gpu_h = self.n * self.job.gpus_per_node / 3600.0
        return SimResult(
            tier=self.tier.tier,
            horizon_s=self.horizon,
            job=self.job,
            ettr=self.work / self.horizon if self.horizon > 0 else 0.0,
            lost_gpu_h={k: v * gpu_h for k, v in self.lost.items()},
            idle_spare_gpu_h=self.idle_node_s * self.job.gpus_per_node / 3600.0,
            exhaustions=self.exhaustions,
            faults=dict(self.faults),
            sizes=self.sizes,
        )


def simulate(
    job: JobShape,
    tier: TierModel,
    horizon_s: float,
    *,
    failures: FailureModel | None = None,
    seed: int = 0,
    schedule: list[Fault] | None = None,
    arrivals: list[_Arrival] | None = None,
) -> SimResult:
    """Simulate ``job`` under ``tier`` for ``horizon_s`` seconds.

    Args:
        failures: random faults of this model, drawn with ``seed``.
        schedule: fixed faults instead (each on a training node).
        arrivals: faults already drawn by :func:`draw_faults` (to share them across runs).
    """
    run = _Run(job, tier, horizon_s)
    if arrivals is None:
        arrivals = []
        if failures is not None:
            arrivals = draw_faults(failures, job, horizon_s, seed, run.reserved)
        arrivals += [
            _Arrival(f, f.kind is not FaultKind.SOFTWARE, 0.0, 1.0) for f in schedule or []
        ]
    for a in arrivals:
        run.push(a.fault.at, "fault", a)
    handlers: dict[str, Callable[[Any], object]] = {
        "fault": run.fault,
        "back": run.back,
        "rejoin": run.rejoin,
        "warm": run.warm,
        "straggler_end": lambda key: run.stragglers.pop(key, None),
        "straggler_swap": run.straggler_swap,
        "mark": lambda _: None,
    }
    while run.events and run.events[0][0] < horizon_s:
        at, _, what, payload = heapq.heappop(run.events)
        run.advance(at)
        handlers[what](payload)
        run.mark()
    run.advance(horizon_s)
    return run.result()
