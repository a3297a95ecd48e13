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
"""

from __future__ import annotations

from orchestrator import keys
from orchestrator.controller.actions import KillWorker
from orchestrator.controller.world import World, workers_of
from orchestrator.records import AgentCommand, Plan
from orchestrator.spec import JobSpec

#: A worker whose heartbeat is older than this many intervals is frozen or gone.
STALE_BEATS = 3


def hung_workers(spec: JobSpec, plan: Plan, world: World, killed: set[str]) -> list[KillWorker]:
    """Kill commands for the hung workers of ``plan``.

    Args:
        spec: the job (``fault_tolerance`` timeouts).
        plan: the current generation.
        world: the snapshot (heartbeats, the time).
        killed: ``<worker>/<pid>`` of the processes already told to die; updated
            here, so one process is told once.
    """
    ft, now = spec.fault_tolerance, world.now
    stale_after = STALE_BEATS * ft.heartbeat_interval.total_seconds()
    current = {
        x: p
        for x in workers_of(plan)
        if (p := world.progress.get(x)) is not None and p.generation == plan.generation
    }
    if len(current) > 1 and all(now - p.beat > stale_after for p in current.values()):
        # A hung worker blocks its peers' steps, not their heartbeats: when every
        # heartbeat stopped at once, it is their way to etcd that is stuck.
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
            if frozen and victim not in killed:
                killed.add(victim)
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
    return out


def exited(world: World, node: str, pid: int) -> bool:
    """The beat is an exited process's last: its node's registration lists the
    pids of the workers its agent runs now (a restarted worker's at once), and
    ``pid`` is not among them.  Its agent already reported the exit; a kill
    would name a process that is gone (a ``WorkerHung`` nobody could act on)."""
    info = world.nodes.get(node)
    return info is not None and bool(info.worker_pids) and pid not in info.worker_pids
