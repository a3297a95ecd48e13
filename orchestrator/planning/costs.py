"""What each tier pays for each kind of fault, from ringmaster's own measurements.

Every default names the benchmark or document it comes from.  They were
measured on a few processes on one 2-core machine over loopback: where a cost
grows with the job (detection across a thousand nodes, moving a node's state)
the figure measured at the largest size there is used, and the step from
there to a larger job is an assumption, said beside it (:data:`NOTES`).
:func:`recovery_model` builds a :class:`~orchestrator.planning.api.RecoveryModel`
for one job; :class:`Measured` holds the figures so a caller (``--from-run``, a
benchmark's replay) can put its own in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from orchestrator.planning.api import Cost, FaultKind, JobShape, RecoveryModel, Tier, TierModel

__all__ = ["NOTES", "Measured", "recovery_model"]


@dataclass(frozen=True)
class Measured:
    """The figures a recovery model is built from (seconds, GB/s).

    The defaults are ringmaster's measurements; each field's comment says where.
    """

    # the controller's watch of each agent: failure -> plan.  README (recovery.py):
    # demo 0.01 s, 0.008-0.02 s at 2-3 nodes; docs/control-plane.md at 1,000 nodes x 8:
    # 0.4-1.4 s (lease loss), 1.6-3.0 s (a crash)
    detect_small_s: float = 0.02
    detect_per_1000_nodes_s: float = 2.3
    # README (recovery_at_size.py, 1 GB): rendezvous 0.22 s (gloo, 3 nodes)
    rendezvous_s: float = 0.22
    # README (recovery_at_size.py): a heal moves 1,511-1,554 MB/s (2 cores, loopback)
    heal_gbps: float = 1.5
    # README (stragglers.py, SIGSTOP): 3 silent heartbeats + 1 watched interval
    hang_heartbeats: float = 4.0
    # README (restart_at_size.py): relaunch to main() 0.21 s; model + DDP 0.73 s at 1 GB
    relaunch_s: float = 0.21
    script_init_s: float = 0.73
    # README (restart_at_size.py): torch.load of 1 GB 0.51 s; durable_restore.py 0.55 s
    load_gbps: float = 1.9
    # README (checkpoint.py --device cuda): torch.save of 1.13 GiB in 2.23 s
    save_gbps: float = 0.54
    # README (checkpoint.py): an async save blocks 0.086-0.117 of a durable torch.save
    async_block_fraction: float = 0.1
    # docs/peers.md: stock torchrun's next step 3.67 s after a node's SIGKILL (2 nodes,
    # c10d, store in its own process); benchmarks/recovery.py: 5.31 s
    torchrun_restart_s: float = 3.67
    # torch.distributed default NCCL timeout (init_process_group: 10 minutes)
    torchrun_hang_s: float = 600.0
    # docs/peers.md: torchft 0.2.0's next step 5.06 s after a kill (Lighthouse
    # heartbeat timeout 5 s); a new replica group's start and heal: assumed 1.4 s
    torchft_stall_s: float = 5.06
    torchft_rejoin_s: float = 1.4
    torchft_group_nodes: int = 8
    # README (stragglers.py): a slow node is called 2.7-3.6 s after it slows down,
    # swapped once it cost its peers `confirm` (5 s) of waiting
    straggler_call_s: float = 3.0
    straggler_confirm_s: float = 5.0
    # docs/peers.md (benchmarks/peers.py, kill every 15 s, load average 8 on 2 cores): a
    # node started at one kill was still importing torch at the next, 15 s later; the
    # controller waited 2.5, 1.4 and 4.6 s for it (the Generation events' "the spare was
    # still starting"): warm 16.4-19.6 s after its start, 17.8 s on average.  On a quiet
    # machine every kill 15 s apart found a warm spare (under 15 s); the loaded figure
    # is kept, since a spare starts beside a job that trains
    spare_warmup_s: float = 17.8


#: What the defaults leave out, said wherever a plan is printed.
NOTES = (
    "recovery costs are ringmaster's measurements on one 2-core machine (README, "
    "docs/peers.md, docs/control-plane.md); detection grows with the job as measured up to "
    "1,000 nodes and is extrapolated beyond; NCCL group formation at thousands of ranks is "
    "not measured (0.22 s with gloo)",
    "peers' costs: docs/peers.md (2 nodes); torchrun's hang waits for NCCL's default "
    "10-minute timeout; torchft's rejoin is an assumption",
    "a replaced node is a warm spare 17.8 s after its start (docs/peers.md, measured on 2 "
    "busy cores); a failure that finds only a spare still starting waits for it",
)


def recovery_model(job: JobShape, m: Measured | None = None) -> RecoveryModel:
    """Every tier's costs for ``job`` (see :class:`Measured` for each figure's source)."""
    m = m or Measured()
    detect = m.detect_small_s + m.detect_per_1000_nodes_s * job.nodes / 1000.0
    heal = job.state_gb / m.heal_gbps
    load = job.state_gb / m.load_gbps
    save = job.state_gb / m.save_gbps
    hang = m.hang_heartbeats * job.heartbeat_s
    restart = Cost(
        detect_s=detect,
        rendezvous_s=m.relaunch_s,
        restore_s=load,
        extra_s=m.script_init_s,
        rework=True,
        source="README: restart_at_size.py (relaunch, the script's model, load and DDP)",
    )
    torchrun = Cost(
        detect_s=m.torchrun_restart_s,
        restore_s=load,
        extra_s=m.script_init_s,
        rework=True,
        source="docs/peers.md: stock torchrun 3.67 s to the next step; load at the same rate",
    )
    swap = Cost(
        detect_s=detect,
        rendezvous_s=m.rendezvous_s,
        restore_s=heal,
        source="README: recovery.py, recovery_at_size.py (detect, rendezvous, heal)",
    )
    planned = replace(swap, detect_s=0.0, in_flight=False)
    in_process = TierModel(
        Tier.IN_PROCESS,
        {
            FaultKind.CRASH: swap,
            FaultKind.HANG: replace(swap, detect_s=hang + detect),
            FaultKind.PREEMPTION: planned,
            FaultKind.STRAGGLER: planned,
            FaultKind.SOFTWARE: restart,
        },
        drop_nodes=job.replica_nodes,
        grow=planned,
        checkpoint_block_s=save * m.async_block_fraction,
        straggler_swap_s=m.straggler_call_s if job.straggler_swap else None,
        straggler_confirm_s=m.straggler_confirm_s,
        spare_warmup_s=m.spare_warmup_s,
    )
    restart_tier = TierModel(
        Tier.RESTART,
        {
            FaultKind.CRASH: restart,
            FaultKind.HANG: replace(restart, detect_s=hang + detect),
            FaultKind.PREEMPTION: restart,
            FaultKind.SOFTWARE: restart,
        },
        drop_nodes=job.replica_nodes,
        grow=replace(restart, rework=False, in_flight=False),
        checkpoint_block_s=save,
        spare_warmup_s=m.spare_warmup_s,
    )
    torchrun_tier = TierModel(
        Tier.TORCHRUN,
        {
            FaultKind.CRASH: torchrun,
            FaultKind.HANG: replace(torchrun, detect_s=m.torchrun_hang_s + m.torchrun_restart_s),
            FaultKind.PREEMPTION: torchrun,
            FaultKind.SOFTWARE: torchrun,
        },
        drop_nodes=job.replica_nodes,
        grow=replace(torchrun, rework=False, in_flight=False),
        checkpoint_block_s=save,
    )
    stall = Cost(
        detect_s=m.torchft_stall_s,
        source="docs/peers.md: torchft's next step 5.06 s after a kill",
    )
    torchft = TierModel(
        Tier.TORCHFT,
        {
            FaultKind.CRASH: stall,
            FaultKind.HANG: stall,
            FaultKind.PREEMPTION: stall,
            FaultKind.SOFTWARE: torchrun,
        },
        uses_spares=False,
        drop_nodes=max(m.torchft_group_nodes, job.replica_nodes),
        rejoin_s=m.torchft_rejoin_s + heal,
        checkpoint_block_s=save,
    )
    tiers = {t.tier: t for t in (torchrun_tier, torchft, restart_tier, in_process)}
    return RecoveryModel(tiers, NOTES)
