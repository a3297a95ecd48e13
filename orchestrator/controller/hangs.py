"""Which workers hang: a pure rule over heartbeats, used by the controller's policy.

A worker hangs when its heartbeat thread stopped (no beat for ``STALE_BEATS``
heartbeat intervals) while its node's agent answers its liveness probe and
has no newer beat from it either (the agent's answer carries the beats it
received: a beat stale only in etcd is waiting for the agent's write, held up
by an etcd leader election, say, and the reader moves it on).  The
heartbeat is a thread of the worker's own, so a silent one beside a live
agent means the whole process is frozen (SIGSTOP, a stuck interpreter), not
a slow step.  Its agent is told to kill it, which turns the hang into a
failure handled like any other: its peers' collectives raise at once, well
before any collective timeout.  A node whose agent does not answer either is
cut off or gone: that is for its lease and its peers' reports to settle, not
for a kill.  When every heartbeat stopped at once, the workers' way to etcd
is stuck (they pause for that), so nobody is killed.

A silence is acted on only once the controller has watched it for a
heartbeat interval and its agent, probed again after the first sighting,
still has no beat either: a stall of the whole machine (or of the controller,
or of etcd: every lease expires at once) leaves every beat old when it ends,
and a worker whose heartbeat thread was merely held up beats again within
that time.  A gap of ``STALE_BEATS`` intervals in the controller's own ticks
(a stall of its own, long enough to make any beat look old) starts every
watch again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from orchestrator.controller.actions import KillWorker
from orchestrator.controller.world import QUIET_BEATS, World, workers_of
from orchestrator.spec.job import JobSpec
from orchestrator.state import keys
from orchestrator.state.records import AgentCommand, Plan

#: A worker whose heartbeat is older than this many intervals is frozen or gone (the
#: world's reader probes its agent from then on).
STALE_BEATS = QUIET_BEATS


@dataclass
class HangWatch:
    """What the controller remembers of silent workers between ticks.

    Attributes:
        killed: ``<worker>/<pid>`` of the processes told to die (each told once).
        silent: ``<worker>/<pid>`` -> the tick (``World.mono``) it was first seen
            silent, in the watch under way.
        last_tick: the previous tick's ``World.mono``.
    """

    killed: set[str] = field(default_factory=set)
    silent: dict[str, float] = field(default_factory=dict)
    last_tick: float | None = None


def confirm_after(spec: JobSpec) -> float:
    """Seconds a silence must be watched before a kill (and its agent probed again)."""
    return spec.fault_tolerance.heartbeat_interval.total_seconds()


def hung_workers(spec: JobSpec, plan: Plan, world: World, watch: HangWatch) -> list[KillWorker]:
    """Kill commands for the hung workers of ``plan``.

    Args:
        spec: the job (``fault_tolerance`` timeouts).
        plan: the current generation.
        world: the snapshot (heartbeats, the time).
        watch: what earlier ticks saw; updated here.
    """
    ft, now = spec.fault_tolerance, world.now
    stale_after = STALE_BEATS * ft.heartbeat_interval.total_seconds()
    confirm = confirm_after(spec)
    if watch.last_tick is None or world.mono - watch.last_tick > stale_after:
        watch.silent.clear()  # the controller itself was held up: what it saw before is old
    watch.last_tick = world.mono
    silent_now: dict[str, float] = {}
    current = {
        x: p
        for x in workers_of(plan)
        if (p := world.progress.get(x)) is not None and p.generation == plan.generation
    }
    if len(current) > 1 and all(now - p.beat > stale_after for p in current.values()):
        # A hung worker blocks its peers' steps, not their heartbeats: when every
        # heartbeat stopped at once, it is their way to etcd that is stuck.
        watch.silent.clear()
        return []
    out: list[KillWorker] = []
    for member in plan.members:
        for i in range(member.nproc):
            worker = keys.worker_id(member.node, i)
            p = current.get(worker)
            if p is None or worker in world.done:  # a finished worker beats no more
                continue
            if exited(world, member.node, p.pid):
                continue
            frozen = now - p.beat > stale_after and member.node in world.answering
            # the record names the process that stopped beating: a restarted
            # worker (a new pid) is never killed for its predecessor's silence,
            # and one process is told once (its agent kills it or is gone itself)
            victim = f"{worker}/{p.pid}"
            if not frozen or victim in watch.killed:
                continue
            first = silent_now[victim] = watch.silent.get(victim, world.mono)
            asked = world.probed_at.get(member.node, -math.inf)
            if world.mono - first >= confirm and asked > first:
                watch.killed.add(victim)
                out.append(
                    KillWorker(
                        member.node,
                        AgentCommand("kill-worker", local_rank=i, pid=p.pid, reason="hang"),
                        worker,
                        f"{worker}: no heartbeat for {now - p.beat:.1f}s (last step "
                        f"{now - p.step_time:.1f}s ago); killing it",
                        silent_since=p.beat,
                    )
                )
    watch.silent = silent_now
    return out


def exited(world: World, node: str, pid: int) -> bool:
    """The beat is an exited process's last: its node's registration lists the
    pids of the workers its agent runs now (a restarted worker's at once), and
    ``pid`` is not among them.  Its agent already reported the exit; a kill
    would name a process that is gone (a ``WorkerHung`` nobody could act on)."""
    info = world.nodes.get(node)
    return info is not None and bool(info.worker_pids) and pid not in info.worker_pids
