"""What the controller does about slow nodes: events, the status, and planned swaps.

Pure (no I/O), run by the controller after its policy each tick
(:meth:`orchestrator.controller.job.JobController.tick`) with the job's
:class:`~orchestrator.controller.stragglers.StragglerWatch`, which keeps the
timing windows and the quarantined nodes between ticks.  It returns actions
for the executor:

* ``Straggler`` / ``StragglerCleared`` events as the watch calls and clears
  nodes (``JobStatus.stragglers`` lists the ones called now);
* with ``fault_tolerance.stragglers.action: swap``, while the job runs, a
  warm spare takes a straggler's slot: the next generation is published with
  the spare in its place (topology-nearest first, as for a dead node).  The
  workers switch at a step boundary as for any planned change: the survivors
  keep their state, the spare receives it from a live peer, no step is lost.
  The straggler stays up, waiting, but is quarantined: never a spare again
  until its agent restarts (a new registration) or an operator releases it
  (``ringmaster release JOB NODE``);
* a swap waits until the straggler has cost the job ``confirm`` (its peers'
  wait for it, summed from its first slow window: :attr:`StragglerWatch.lost`),
  so that a burst of contention on a busy host does not take a spare;
* a swap is made only when it pays: the time it saves over the rest of the
  job (the remaining steps at the current step time, less what they would
  take at the peers' pace; without ``max_steps`` the rest is taken as
  unbounded) must beat its cost (the job's last recovery, else
  :data:`DEFAULT_SWAP_COST_S`) by ``min_gain``.  Otherwise, and without a
  warm spare, a ``StragglerKept`` event says why, once per straggler.
"""

from __future__ import annotations

import math

from orchestrator.api import JobPhase
from orchestrator.controller.actions import Action, Emit, ProbeLinks, PublishPlan, ReleaseNode
from orchestrator.controller.plans import (
    is_warm,
    make_plan,
    node_info,
    swap_in_spares,
    topology_ordered,
)
from orchestrator.controller.slow_links import LinkProbeResult
from orchestrator.controller.stragglers import Straggler, StragglerWatch
from orchestrator.controller.world import World
from orchestrator.spec.job import JobSpec, StragglerAction
from orchestrator.state.records import JobStatus, Plan

__all__ = ["DEFAULT_SWAP_COST_S", "decide_stragglers", "swap_gain"]

#: Seconds a swap is taken to cost before the job has recovered once (a planned switch
#: measured here takes well under that; the job's last recovery replaces it).
DEFAULT_SWAP_COST_S = 2.0


def decide_stragglers(
    spec: JobSpec,
    watch: StragglerWatch,
    status: JobStatus,
    world: World,
    actions: list[Action],
    equal_sites: bool = False,
) -> list[Action]:
    """This tick's actions about slow nodes (``actions``: what the policy decided;
    ``equal_sites``: the sites must stay of one size, so a swap takes a spare of the
    straggler's own site: :mod:`orchestrator.controller.site_balance`)."""
    out = _releases(watch, world, actions)
    plan = world.plan
    config = spec.fault_tolerance.stragglers
    busy = any(isinstance(a, PublishPlan) for a in actions)  # the policy changes the group
    probed = world.link_probe
    if config.action is StragglerAction.OFF or plan is None or busy:
        if probed is not None:
            watch.links.verdict(LinkProbeResult({}))  # measured for a group that is going
        return out
    if status.phase is not JobPhase.RUNNING:
        if probed is not None:
            watch.links.verdict(LinkProbeResult({}))
        return out
    called, cleared = watch.tick(plan, world.progress, world.mono)
    if probed is not None:
        members = {m.node for m in plan.members}
        called += watch.take_probe(probed, members)
        if not called:
            rates = _rates_mb_s(probed)
            out.append(
                Emit(
                    "LinkProbe",
                    f"links measured, none slower than the others: {_rates(probed)}",
                    {"rates_mb_s": rates},
                )
            )
    if watch.probe_wanted:
        out += _probe(watch, world, plan)
    for s in called:
        tail = "; reported only (fault_tolerance.stragglers.action: report)"
        if config.action is StragglerAction.SWAP:
            tail = (
                f"; it has cost the job {watch.lost.get(s.node, 0.0):.1f}s so far, and a "
                f"spare takes its slot at {config.confirm.total_seconds():g}s"
            )
        out.append(
            Emit(
                "Straggler", s.describe() + tail, {"node": s.node, "slowdown": round(s.slowdown, 3)}
            )
        )
    for node in cleared:
        out.append(
            Emit("StragglerCleared", f"{node} steps at its peers' pace again", {"node": node})
        )
    status.stragglers = {n: round(s.slowdown, 2) for n, s in sorted(watch.flagged.items())}
    status.quarantined = sorted(watch.quarantined)
    if config.action is StragglerAction.SWAP:
        out += _swap(spec, watch, status, world, plan, equal_sites)
    return out


def _probe(watch: StragglerWatch, world: World, plan: Plan) -> list[Action]:
    """Ask the members' and the spares' agents to measure their links."""
    watch.probe_wanted = False
    members = [m.node for m in plan.members]
    nodes = members + sorted(n for n in world.nodes if n not in members)  # spares too
    ports = {
        n: world.nodes[n].liveness for n in nodes if n in world.nodes and n not in world.quarantined
    }
    usable = {n: p for n, p in ports.items() if p}
    if len(usable) < 3:  # two ends of one slow pair cannot say which end is slow
        watch.links.verdict(LinkProbeResult({}))
        return []
    links = watch.links
    return [
        ProbeLinks(usable),
        Emit(
            "LinkProbe",
            f"the ranks wait {links.wait_s * 1000:.1f} ms per step for the "
            f"gradient exchange (at least {(links.base_wait_s or 0) * 1000:.1f} ms before) "
            f"and no node computes slower than the others: measuring the links between "
            f"{', '.join(sorted(usable))}",
            {"nodes": sorted(usable)},
        ),
    ]


def _rates_mb_s(probed: LinkProbeResult) -> dict[str, dict[str, float]]:
    """The probe's rates in MB/s (10^6 bytes per second), by sender and receiver."""
    return {
        a: {b: round(bps / 1e6, 3) for b, bps in sorted(row.items())}
        for a, row in sorted(probed.rates.items())
    }


def _rates(probed: LinkProbeResult) -> str:
    pairs = [
        f"{a}->{b} {mb:.1f} MB/s" for a, row in _rates_mb_s(probed).items() for b, mb in row.items()
    ]
    return ", ".join(pairs) or "no answer"


def swap_gain(spec: JobSpec, status: JobStatus, straggler: Straggler) -> tuple[float, float] | None:
    """Seconds a swap would save over the rest of the job, and what it costs; None
    while the job's step rate is not known yet."""
    if status.steps_per_s <= 0:
        return None
    step_s = 1.0 / status.steps_per_s
    left = max(spec.max_steps - status.step, 0) if spec.max_steps else math.inf
    gain = left * step_s * (1.0 - 1.0 / straggler.slowdown) if left else 0.0
    cost = DEFAULT_SWAP_COST_S
    if status.last_recovery and status.last_recovery.get("total_s"):
        cost = float(status.last_recovery["total_s"])
    return gain, cost


def _releases(watch: StragglerWatch, world: World, actions: list[Action]) -> list[Action]:
    """Quarantined nodes let go: by an operator's command, or because their agent restarted."""
    out: list[Action] = []
    for a in actions:
        if isinstance(a, ReleaseNode):
            if watch.quarantined.pop(a.node, None) is None:
                out.append(Emit("BadCommand", f"release: {a.node} is not quarantined"))
                continue
            out.append(
                Emit(
                    "NodeReleased",
                    f"{a.node} released by an operator: it may be a spare again",
                    {"node": a.node},
                )
            )
    for node, started in list(watch.quarantined.items()):
        info = world.nodes.get(node)
        if info is not None and started is None:  # quarantined under another leader
            watch.quarantined[node] = info.started
        elif info is not None and info.started != started:
            del watch.quarantined[node]
            out.append(
                Emit(
                    "NodeReleased",
                    f"{node}'s agent started again: it may be a spare again",
                    {"node": node},
                )
            )
    return out


def _swap(
    spec: JobSpec,
    watch: StragglerWatch,
    status: JobStatus,
    world: World,
    plan: Plan,
    equal_sites: bool,
) -> list[Action]:
    """A warm spare in the slowest straggler's slot, when that pays (else why not, once)."""
    members = [m.node for m in plan.members]
    slow = sorted((s for n, s in watch.flagged.items() if n in members), key=lambda s: -s.slowdown)
    if not slow:
        return []
    straggler = slow[0]
    node = straggler.node
    spares = [
        n
        for n in topology_ordered(spec, world, list(world.nodes))
        if n not in members and n not in watch.quarantined and is_warm(spec, world, n, False)
    ]
    if equal_sites:  # a spare of another site would leave the sites of two sizes
        site = node_info(spec, world, node).site(spec.sync.site_label)
        spares = [n for n in spares if node_info(spec, world, n).site(spec.sync.site_label) == site]
    if not spares:
        return _kept(watch, node, "no warm spare to take its slot: reported only")
    lost = watch.lost.get(node, 0.0)
    if lost < spec.fault_tolerance.stragglers.confirm.total_seconds():
        return []  # not confirmed yet: it may be a burst of contention
    priced = swap_gain(spec, status, straggler)
    if priced is None:
        return []
    gain, cost = priced
    if gain - cost < spec.fault_tolerance.stragglers.min_gain.total_seconds():
        return _kept(
            watch,
            node,
            f"a swap would save {gain:.1f}s over the rest of the job against its cost of "
            f"{cost:.1f}s, less than fault_tolerance.stragglers.min_gain: reported only",
        )
    order, swapped, left = swap_in_spares(spec, world, plan, {node}, spares)
    why = f"{'; '.join(swapped)} (a straggler, {straggler.slowdown:.2f}x its peers' step)"
    new_plan = make_plan(spec, world, plan.generation + 1, order, left, why)
    info = world.nodes.get(node)
    watch.quarantined[node] = info.started if info is not None else 0.0
    watch.forget({node})
    status.spare_nodes = list(left)
    status.quarantined = sorted(watch.quarantined)
    status.message = f"generation {new_plan.generation}: {why}"
    message = (
        f"generation {new_plan.generation}: {why}; it had cost the job {lost:.1f}s, and the "
        f"swap saves about {gain:.0f}s over the rest of the job against a cost of "
        f"{cost:.1f}s. {node} is quarantined: not a spare again "
        f"until its agent restarts or `ringmaster release {status.name} {node}`"
    )
    return [PublishPlan(new_plan), Emit("StragglerSwapped", message, {"node": node})]


def _kept(watch: StragglerWatch, node: str, why: str) -> list[Action]:
    """Say once per straggler why it keeps its slot."""
    if node in watch.kept:
        return []
    watch.kept.add(node)
    return [Emit("StragglerKept", f"{node} keeps its slot: {why}", {"node": node})]
