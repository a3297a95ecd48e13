"""Which nodes can take a slot, and the plans built from them.

Pure functions over the job spec and a :class:`~orchestrator.controller.world.World`,
used by the policy (:mod:`orchestrator.controller.policy`): it decides *when*
a generation starts or changes; these say *which* nodes and in *what* order:

* :func:`is_warm`: a node ready for a slot (its workers beat; in the restart
  tier, its agent registered);
* :func:`start_members`: the first generation's members and warm spares, in
  topology order, spares spread over racks;
* :func:`startup_failure`: every node's workers failed alike before a step;
* :func:`storage_split`: the nodes do not read one script checkpoint;
* :func:`swap_in_spares`: a warm spare for each failed member, nearest first;
* :func:`survivor_first`: the restart tier's ring turned so that rank 0 is a survivor;
* :func:`make_plan`: a generation, its members' rank bases in ring order;
* :func:`trains_again`: every member of a new generation is past the break;
* :func:`restart_tier`: whether the job's nodes run the restart tier.

Runs in the controller.
"""

from __future__ import annotations

from orchestrator.controller.hangs import STALE_BEATS
from orchestrator.controller.memory import Memory
from orchestrator.controller.placement import (
    nearest_spare,
    replacement_order,
    spares_by_site,
    spread_spares,
)
from orchestrator.controller.world import World, workers_of
from orchestrator.spec.job import JobSpec, RecoveryMode
from orchestrator.state import keys
from orchestrator.state.records import Member, NodeRecord, Plan
from orchestrator.topology import NodeInfo, topology_order

__all__ = [
    "end_wait",
    "is_warm",
    "make_plan",
    "node_info",
    "restart_tier",
    "start_members",
    "startup_failure",
    "storage_split",
    "survivor_first",
    "swap_in_spares",
    "topology_ordered",
    "trains_again",
]


def restart_tier(spec: JobSpec, nodes: dict[str, NodeRecord]) -> bool:
    """Whether the job runs in the restart tier: said by the spec, or, for ``auto``
    (a job submitted without the entrypoint check), by the agents that resolved it."""
    mode = spec.fault_tolerance.recovery
    if mode is not RecoveryMode.AUTO:
        return mode is RecoveryMode.RESTART
    return any(n.recovery == RecoveryMode.RESTART.value for n in nodes.values())


def is_warm(spec: JobSpec, world: World, node: str, restart_tier: bool) -> bool:
    """A registered node whose every worker is alive and beating (ready for a slot), that
    is not quarantined for being slow, and whose agent's watch did not close.

    In the restart tier, a registered node: its agent registers once its
    standbys are started, and its workers write no heartbeats.
    """
    info = world.nodes.get(node)
    if info is None or node in world.quarantined or node in world.closed:
        return False
    if restart_tier:
        return True
    stale = STALE_BEATS * spec.fault_tolerance.heartbeat_interval.total_seconds()
    for i in range(info.slots):
        p = world.progress.get(keys.worker_id(node, i))
        if p is None or world.now - p.beat > stale or p.pid not in info.worker_pids:
            return False
    return True


def end_wait(
    memory: Memory, world: World, members: list[str], order: list[str]
) -> tuple[str, float]:
    """End a replacement's wait for nodes (``memory.short_since``); say what held it
    back, for its plan's reason (empty when it did not wait), and for how many
    seconds (0.0 when no node came to end it): the recovery record shows that
    wait apart from detection.

    A node of ``order`` that had registered when the wait began was a spare
    still starting (its workers not warm yet); otherwise a node joined during it.
    """
    since, memory.short_since = memory.short_since, None
    if since is None:
        return "", 0.0
    waited = world.mono - since
    began = world.now - waited  # wall clock, as the registrations
    came = [world.nodes.get(n) for n in order if n not in members]
    if any(info is not None and info.started <= began for info in came):
        return f"; the spare was still starting: {waited:.1f}s", waited
    return (f"; no spare for {waited:.1f}s", waited) if came else ("", 0.0)


def node_info(spec: JobSpec, world: World, node: str) -> NodeInfo:
    """A node's slots and topology labels (a node gone from etcd: the spec's slots, no labels)."""
    info = world.nodes.get(node)
    slots = info.slots if info is not None else spec.nproc_per_node
    return NodeInfo(node, slots, dict(info.labels) if info is not None else {})


def topology_ordered(
    spec: JobSpec, world: World, nodes: list[str], previous: list[str] | None = None
) -> list[str]:
    """``nodes`` in topology order (:func:`orchestrator.topology.topology_order`)."""
    infos = [node_info(spec, world, n) for n in nodes]
    return list(topology_order(infos, spec.comm.topology_labels, previous).node_ids)


def make_plan(
    spec: JobSpec, world: World, generation: int, order: list[str], spares: list[str], why: str
) -> Plan:
    """Generation ``generation``: the nodes of ``order`` take ranks in that order."""
    members, base = [], 0
    for node in order:
        info = node_info(spec, world, node)
        members.append(Member(node, base, info.slots, dict(info.labels)))
        base += info.slots
    return Plan(generation, members, spares=list(spares), reason=why)


def start_members(spec: JobSpec, world: World, warm: list[str]) -> tuple[list[str], list[str]]:
    """The first generation: (members in ring order, warm spares spread over racks, or
    over sites under a delayed sync)."""
    ordered = topology_ordered(spec, world, warm)
    infos = [node_info(spec, world, n) for n in ordered]
    labels = spec.comm.topology_labels
    count = len(ordered) - spec.nodes.max
    if spec.sync.delayed:  # every site keeps members
        waiting = set(spares_by_site(infos, count, spec.sync.site_label))
    else:
        waiting = set(spread_spares(infos, count, labels))
    active = topology_ordered(spec, world, [n for n in ordered if n not in waiting])
    return active, [n for n in ordered if n in waiting]


def joining(
    spec: JobSpec,
    world: World,
    plan: Plan,
    dropped: dict[str, float | None],
    restart_tier: bool,
) -> list[str]:
    """The warm nodes a generation below ``nodes.max`` takes in (a scale-up), in
    topology order, up to ``nodes.max``: none is a member, none is known gone, and
    none is a node a plan dropped that has not registered again since.
    """
    members = {m.node for m in plan.members}
    room = spec.nodes.max - len(members)
    if room <= 0:
        return []
    found = []
    for node, info in world.nodes.items():
        if node in members or node in world.agents_gone:
            continue
        failed_agent = dropped.get(node)
        if failed_agent is not None and info.started <= failed_agent:
            continue  # its registration from before the failure, not yet expired
        if is_warm(spec, world, node, restart_tier):
            found.append(node)
    return topology_ordered(spec, world, found)[:room]


def start_ready(spec: JobSpec, world: World, warm: list[str], since_min: float | None) -> bool:
    """Whether the first generation can start now.

    At ``nodes.max`` warm nodes, or ``nodes.min`` for ``rendezvous.last_call_timeout``
    (``since_min``: seconds since ``nodes.min`` were warm).  A delayed sync
    (``sync.mode`` diloco) places sites: its members and spares are chosen once
    every registered node is warm, or after the last call, so that a node that
    registered a moment late does not leave its site without members.
    """
    last_call = spec.rendezvous.last_call_timeout.total_seconds()
    called = since_min is not None and since_min >= last_call
    if len(warm) >= spec.nodes.max:
        return called or not spec.sync.delayed or len(warm) >= len(world.nodes)
    return len(warm) >= spec.nodes.min and called


def startup_failure(spec: JobSpec, world: World, warm: list[str]) -> str | None:
    """Why the job fails before it started, when every node's workers failed the same way.

    A script that cannot start (a missing file or module, a syntax error)
    fails alike on every node; waiting for ``join_timeout`` would not help.
    None while any node is warm, or the failures differ or are not all in.
    """
    failures = world.startup_failures
    known = set(world.nodes) | set(failures)
    if warm or len(known) < spec.nodes.min or set(failures) != known:
        return None
    reasons = set(failures.values())
    if len(reasons) != 1:
        return None
    return (
        f"the workers of every node ({', '.join(sorted(known))}) failed before their "
        f"first step: {reasons.pop()}; fix the entrypoint and submit the job again"
    )


def storage_split(world: World, nodes: list[str]) -> str | None:
    """Why the job cannot start when its nodes do not read one script checkpoint.

    Restart tier: each agent registers where the script's own checkpoint is as
    it sees it (``NodeRecord.script_storage``: its host and the real path).  Two
    places mean a node that takes another's slot after a failure finds no
    checkpoint and trains from zero, out of step with the nodes that resumed:
    that fails at the start, not silently later.  None when they agree (or do
    not say: object storage, a shared filesystem, a path the script computes).
    """
    seen: dict[str, list[str]] = {}
    for n in nodes:
        info = world.nodes.get(n)
        if info is not None and info.script_storage:
            seen.setdefault(info.script_storage, []).append(n)
    if len(seen) < 2:
        return None
    places = "; ".join(f"{', '.join(sorted(ns))} at {where}" for where, ns in sorted(seen.items()))
    return (
        f"the script's own checkpoint is not in one place every node reads ({places}): a "
        "node that takes another's place after a failure would find no checkpoint and "
        "train from zero; save it under $RINGMASTER_CHECKPOINT_DIR with checkpoint.url "
        "on storage every node reads (s3://... or a shared filesystem), or at an absolute "
        "path on such storage, or start every agent in one directory on one machine"
    )


def swap_in_spares(
    spec: JobSpec, world: World, plan: Plan, failed: set[str], spares: list[str]
) -> tuple[list[str], list[str], list[str]]:
    """A spare for each failed member of ``plan``, as long as spares last.

    Args:
        spares: warm spares in topology order.

    Returns:
        The next generation's members in ring order, what was swapped in words
        (``b replaces a``), and the spares left.
    """
    spares = list(spares)
    labels = spec.comm.topology_labels
    members = [m.node for m in plan.members]
    swaps: dict[str, NodeInfo] = {}
    for node in [n for n in members if n in failed]:
        if spares:
            old = plan.member(node)
            gone = NodeInfo(node, 1, dict(old.labels) if old is not None else {})
            spare = nearest_spare(gone, [node_info(spec, world, s) for s in spares], labels)
            spares.remove(spare.node_id)
            swaps[node] = spare
    swapped = [f"{spare.node_id} replaces {node}" for node, spare in swaps.items()]
    staying = [node_info(spec, world, n) for n in members if n not in failed or n in swaps]
    return replacement_order(staying, swaps, labels), swapped, spares


def survivor_first(order: list[str], previous: list[str], failed: set[str]) -> list[str]:
    """``order`` turned so that its first node, rank 0, is a survivor of ``previous``.

    The restart tier's scripts are ordinary torchrun scripts: they restore
    from their own checkpoint and DDP then broadcasts rank 0's parameters to
    every rank.  A spare that took a dead node's slot may see no checkpoint at
    all (a node-local disk, a path relative to where its agent started): as
    rank 0 it would broadcast freshly initialised weights over what the
    survivors restored, and the job's progress would be gone without a word.
    Rank 0 therefore goes to the survivor that held the lowest rank before.
    Turning a ring keeps every neighbour, so the ring crosses no more rack or
    zone boundaries than before.  With no survivor (every member replaced),
    ``order`` is returned as it is.

    Args:
        order: the next generation's nodes in ring order.
        previous: the broken generation's nodes in rank order.
        failed: the nodes of ``previous`` that are replaced.
    """
    survivors = [n for n in previous if n not in failed and n in order]
    if not survivors or order[0] in survivors:
        return list(order)
    at = order.index(survivors[0])
    return order[at:] + order[:at]


def trains_again(plan: Plan, world: World, restart_tier: bool, since_step: int) -> bool:
    """Every worker of ``plan`` stepped past ``since_step`` in it, and completed a step in
    it where its telemetry tells (the recovery is over).

    In the restart tier (no step heartbeats): once every member's agent launched
    it and, where the agents report it, a worker showed progress (a first line of
    output: ``NodeRecord.progress_at``; None from an agent whose workers do not
    tell, 0 while they may still).
    """
    if restart_tier:
        infos = [world.nodes.get(m.node) for m in plan.members]
        if not all(i is not None and i.generation == plan.generation for i in infos):
            return False
        told = [i.progress_at for i in infos if i is not None]
        return any(told) or all(p is None for p in told)
    for x in workers_of(plan):
        p = world.progress.get(x)
        if p is None or p.generation != plan.generation or p.step <= since_step:
            return False
        # the step alone may be a stale heartbeat's (a death seen before any report):
        # a worker restored in this generation that has not stepped in it is not done
        t = p.telemetry
        if t.generation == plan.generation and t.first_step_at is None:
            return False
    return True
