"""Contracts of the planner: a job, its failures, what recovering costs, what came of it.

A plan simulates one :class:`JobShape` under a :class:`FailureModel` (how often
nodes fail, how, and how long they take to come back) and a
:class:`RecoveryModel` (what each :class:`Tier` pays for each :class:`FaultKind`),
and reports a :class:`SimResult` per tier.  Everything here is plain data: the
planner imports neither torch nor etcd, so it runs wherever the CLI does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from orchestrator.api import OrchestratorError

__all__ = [
    "LOSS_CAUSES",
    "Cost",
    "FailureModel",
    "FailureSource",
    "Fault",
    "FaultKind",
    "JobShape",
    "PlanError",
    "RecordedFault",
    "RecordedRun",
    "RecoveryModel",
    "SimResult",
    "Tier",
    "TierModel",
]


class PlanError(OrchestratorError):
    """A plan cannot be made: a bad failure model file, a job that cannot train, no records."""


class Tier(str, Enum):
    """The ways a job can recover, simulated side by side."""

    TORCHRUN = "torchrun"  # every worker restarts from the last checkpoint
    TORCHFT = "torchft"  # the replica group holding the node drops, heals from a live one
    RESTART = "ringmaster-restart"  # warm spares, every worker relaunched from standbys
    IN_PROCESS = "ringmaster-in-process"  # warm spare swapped in, survivors keep memory


class FaultKind(str, Enum):
    """What happened to a node (or, for ``software``, to every worker at once)."""

    CRASH = "crash"  # the node is gone (GPU, memory, NIC, power, a switch)
    HANG = "hang"  # its workers stop making progress without exiting
    STRAGGLER = "straggler"  # it keeps training, slower than its peers
    PREEMPTION = "preemption"  # it is taken away with notice (maintenance, spot)
    SOFTWARE = "software"  # the script or a library fails on every rank: a restart


@dataclass(frozen=True)
class FailureSource:
    """One cause of interruptions and how often it strikes.

    Attributes:
        name: what failed (``faulty GPU``, ``network switch``).
        kind: how the job sees it.
        per_node_day: events per node per day (``software``: per job-node per day,
            so a job's rate scales with its size as in the published counts).
        nodes: nodes one event takes (more than 1: correlated, a switch or a rack).
        repair_s: mean seconds until a failed node is back (drawn exponentially).
        slowdown: stragglers: how many times as long the node takes per step.
        duration_s: stragglers: mean seconds the slowdown lasts.
        swappable: stragglers: whether replacing the node ends it (a slow node), or
            not (a slow data shard, an imbalanced stage: the spare would be as slow).
        citation: where the figure comes from.
    """

    name: str
    kind: FaultKind
    per_node_day: float
    nodes: int = 1
    repair_s: float = 6 * 3600.0
    slowdown: float = 1.0
    duration_s: float = 0.0
    swappable: bool = True
    citation: str = ""


@dataclass(frozen=True)
class FailureModel:
    """A named set of :class:`FailureSource` s, with where their figures come from."""

    name: str
    sources: tuple[FailureSource, ...]
    citation: str = ""
    assumptions: tuple[str, ...] = ()

    def per_node_day(self, kinds: tuple[FaultKind, ...] | None = None) -> float:
        """Events per node per day, of ``kinds`` (default: every kind)."""
        return sum(s.per_node_day for s in self.sources if kinds is None or s.kind in kinds)


@dataclass(frozen=True)
class Fault:
    """One scheduled fault, for a replay instead of random arrivals (a benchmark's schedule).

    ``repair_s`` is when the nodes are back, counted from ``at``.  ``cost``, when
    given, is what this fault cost in a recorded run and replaces the tier's cost
    of its kind (a replay of that run).
    """

    at: float
    kind: FaultKind
    nodes: int = 1
    repair_s: float = 0.0
    slowdown: float = 1.0
    duration_s: float = 0.0
    cost: Cost | None = None


@dataclass(frozen=True)
class JobShape:
    """The job as the planner sees it.

    Attributes:
        nodes: nodes that train (the job's full size).
        gpus_per_node: GPUs (ranks) per node.
        spares: warm spare nodes reserved beside them (torchft runs without).
        min_nodes: the fewest nodes it trains on (``nodes.min``); fewer: it waits.
        step_s: seconds per training step.
        state_gb: GB of training state a node holds (what a heal or a load moves).
        checkpoint_every_s: seconds of training between durable checkpoints.
        replica_nodes: nodes of one model replica, the smallest part the job can
            drop when it shrinks (1 for DDP; tensor x pipeline size / GPUs per node).
        straggler_swap: whether a slow node is swapped for a spare
            (``fault_tolerance.stragglers.action: swap``).
        heartbeat_s: ``fault_tolerance.heartbeat_interval``.
    """

    nodes: int
    gpus_per_node: int = 8
    spares: int = 0
    min_nodes: int | None = None
    step_s: float = 2.0
    state_gb: float = 10.0
    checkpoint_every_s: float = 1800.0
    replica_nodes: int = 1
    straggler_swap: bool = True
    heartbeat_s: float = 2.0

    @property
    def floor(self) -> int:
        """The fewest nodes the job trains on."""
        return self.nodes if self.min_nodes is None else min(self.min_nodes, self.nodes)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Cost:
    """What one fault costs the whole job, split as a recovery record splits it.

    ``detect_s`` + ``rendezvous_s`` + ``restore_s`` + ``extra_s`` is the time
    the job does not train; ``rework`` says whether the work since the last
    durable checkpoint is lost too; ``in_flight`` whether the step running at the
    fault is lost (not for a planned departure at a step boundary); ``rework_s``
    seconds of training done again that a recorded run counted (its steps re-run),
    taken back beside ``rework``.
    """

    detect_s: float = 0.0
    rendezvous_s: float = 0.0
    restore_s: float = 0.0
    extra_s: float = 0.0
    rework: bool = False
    in_flight: bool = True
    source: str = ""
    rework_s: float = 0.0

    @property
    def stop_s(self) -> float:
        return self.detect_s + self.rendezvous_s + self.restore_s + self.extra_s


@dataclass(frozen=True)
class TierModel:
    """How one tier handles each kind of fault.

    Attributes:
        costs: the cost of each kind of fault (a straggler's is the swap's).
        uses_spares: whether failed nodes are replaced from the job's spares.
        drop_nodes: nodes taken out of training per failed node when it is not
            replaced (torchft: its replica group; otherwise the job's replica).
        rejoin_s: seconds after a node is back before it trains again (torchft:
            the group's start and heal; the others pay ``grow`` instead).
        grow: what adding nodes back to a shrunk job costs the job.
        checkpoint_block_s: seconds training stops for one durable checkpoint.
        straggler_swap_s: seconds from a straggler's start to its swap, as a
            function input: the detection delay; None: the tier never swaps.
        straggler_confirm_s: seconds of peers' waiting before a swap is confirmed.
        spare_warmup_s: seconds from a replaced node's start until it is a warm spare
            (its workers have imported what the first step needs); a failure that finds
            no warm spare but one starting waits for it.
    """

    tier: Tier
    costs: dict[FaultKind, Cost]
    uses_spares: bool = True
    drop_nodes: int = 1
    rejoin_s: float = 0.0
    grow: Cost = field(default_factory=Cost)
    checkpoint_block_s: float = 0.0
    straggler_swap_s: float | None = None
    straggler_confirm_s: float = 5.0
    spare_warmup_s: float = 0.0


@dataclass(frozen=True)
class RecoveryModel:
    """Every tier's :class:`TierModel` for one job, and where each figure comes from."""

    tiers: dict[Tier, TierModel]
    notes: tuple[str, ...] = ()


#: Where the GPU-hours that did not train went.
LOSS_CAUSES = (
    "recovery",  # the job stopped: detect, rendezvous, restore, the step lost in flight
    "rework",  # work since the last durable checkpoint trained again
    "checkpoints",  # training blocked by saves
    "smaller",  # the job trained on fewer nodes than its size
    "waiting",  # fewer nodes than nodes.min: nothing trained
    "stragglers",  # every rank waited for a slow one
)


@dataclass
class SimResult:
    """One tier's simulated run.

    Attributes:
        ettr: effective training time ratio: the work done, in seconds of the
            whole job training at full speed, over the wall time.
        lost_gpu_h: GPU-hours of the job's size that did not train, by
            :data:`LOSS_CAUSES`.
        idle_spare_gpu_h: GPU-hours of spares held idle (beside the job's size).
        exhaustions: failures that found no spare left.
        faults: faults that hit the job, by kind.
        sizes: ``(seconds, nodes training)`` each time it changed (0 while stopped).
    """

    tier: Tier
    horizon_s: float
    job: JobShape
    ettr: float
    lost_gpu_h: dict[str, float]
    idle_spare_gpu_h: float
    exhaustions: int
    faults: dict[str, int]
    sizes: list[tuple[float, int]]

    @property
    def days(self) -> float:
        return self.horizon_s / 86400.0

    @property
    def lost_gpu_h_per_day(self) -> float:
        return sum(self.lost_gpu_h.values()) / self.days if self.days > 0 else 0.0

    @property
    def goodput_per_reserved(self) -> float:
        """Work done per GPU reserved (the job's size and its spares)."""
        held = self.job.nodes + (self.job.spares if self.tier is not Tier.TORCHFT else 0)
        return self.ettr * self.job.nodes / held if held else 0.0


@dataclass(frozen=True)
class RecordedFault:
    """One fault of a recorded run and what it cost there.

    Attributes:
        at: seconds from the run's first completed step.
        stop_s: seconds the job did not train because of it; None: it did not train
            again within the run.
        rework_s: seconds of training done again (completed steps lost x the step).
        warm_spare: whether a warm spare stood ready (None: not recorded, or no spares).
        waited_s: seconds the replacement waited for a spare still starting (0: none).
    """

    at: float
    stop_s: float | None
    rework_s: float = 0.0
    warm_spare: bool | None = None
    waited_s: float = 0.0


@dataclass(frozen=True)
class RecordedRun:
    """A run's faults as its own records give them, and the effective training it measured.

    Attributes:
        name: what ran (``ringmaster-in-process, kill every 15 s``).
        tier: how it recovered.
        window_s: seconds from its first completed step to the end of the measure.
        step_s: its fault-free step time.
        nodes, spares: training nodes and warm spares.
        faults: in time order.
        measured: the effective training it measured (productive time over ``window_s``).
        in_flight: whether the step running at each fault is lost beside ``stop_s``
            (``stop_s`` ends where the next step starts) or inside it.
        checkpoint_s: seconds its saves blocked training within the window.
        tail_s: seconds at the end of the window after its latest step (not training).
        source: where the records come from.
    """

    name: str
    tier: Tier
    window_s: float
    step_s: float
    nodes: int
    spares: int
    faults: tuple[RecordedFault, ...]
    measured: float
    in_flight: bool = True
    checkpoint_s: float = 0.0
    tail_s: float = 0.0
    source: str = ""
