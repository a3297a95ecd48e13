"""One typed record for every value stored under :mod:`orchestrator.state.keys`.

Agents, workers, the controller and the CLI talk through etcd; what they
write there is one of the dataclasses below, never a hand-built dict.  Each
record is stored as JSON with a format version (``"v"``) beside its fields.
Reading goes through :func:`decode`, which checks every field against the
record's types: a missing required field, a value of the wrong type or a
record written by a newer format is a :class:`RecordError` that names the
key, never a silent default.  Fields with a default in the dataclass are
optional in the stored form (they were added later or are often empty).

The records, by key (see :mod:`orchestrator.state.keys` for the layout):

==============================  =========================================
``spec``                        :class:`SpecRecord`
``status``                      :class:`JobStatus`
``events/<seq>``                :class:`Event`
``nodes/<node>``                :class:`NodeRecord` (leased)
``commands/<seq>``              :class:`CommandRecord`
``plan``                        :class:`Plan` (of :class:`Member`)
``checkpoint``                  :class:`CheckpointRecord` (its own module)
``control``                     :class:`ControlRecord`
``reports/<gen>/<w>``           :class:`BreakReport`
``node-reports/<gen>/<node>``   :class:`NodeBreakReports` (its workers' BreakReports)
``progress/<w>``                :class:`ProgressRecord` (with :class:`Telemetry`)
``node-progress/<node>``        :class:`NodeProgressRecord` (its workers' ProgressRecords)
``done/<w>``                    :class:`DoneRecord`
``agents/<node>/cmd/<seq>``     :class:`AgentCommand`
``logs/<node>/<lr>/<t>``        :class:`LogChunk`
``history/<ns>``                :class:`~orchestrator.observe.records.HistorySample`
``recoveries/<run>-<gen>``      :class:`~orchestrator.observe.records.RecoveryRecord`
``runs/<run>``                  :class:`RunRecord`
==============================  =========================================

The observers' own records (the job's history, one record per recovery) are
beside the observers, in :mod:`orchestrator.observe.records`.

Over 450 lines, kept whole: it is the table above made code, one dataclass per
stored value and nothing else; split, the keyspace's types would be looked for
in several places.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.api import JobPhase
from orchestrator.state.api import RecordError
from orchestrator.state.checkpoint_record import (
    CHECKPOINT_RECORD_KEEPS,
    CheckpointRecord,
    CommittedCheckpoint,
)
from orchestrator.state.codec import FORMAT, Record, decode, read, read_all, write

__all__ = [
    "CHECKPOINT_RECORD_KEEPS",
    "FORMAT",
    "AgentCommand",
    "BreakReport",
    "CheckpointRecord",
    "CommandRecord",
    "CommittedCheckpoint",
    "ControlRecord",
    "DoneRecord",
    "Event",
    "JobStatus",
    "LogChunk",
    "Member",
    "NodeBreakReports",
    "NodeProgressRecord",
    "NodeRecord",
    "Plan",
    "ProgressRecord",
    "Record",
    "RecordError",
    "ResumeRequest",
    "RunRecord",
    "SpecRecord",
    "Telemetry",
    "TrainingTime",
    "decode",
    "read",
    "read_all",
    "write",
]


# --------------------------------------------------------------------------- records


@dataclass
class Member(Record):
    """One node of a generation and the global ranks its workers take.

    Ranks ``rank_base .. rank_base + nproc - 1`` belong to this node, in local-rank
    order; nodes appear in topology order, so ring neighbours share host, then rack.
    """

    node: str
    rank_base: int
    nproc: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Plan(Record):
    """Who trains in a generation.  Written by the controller, read by every worker.

    A new generation is published whenever membership changes (failure, hot-swap,
    drain, scale); workers of the listed nodes re-form the process group for it
    in-process.  ``generation`` only grows; it also fences stale writers.
    """

    generation: int
    members: list[Member]
    spares: list[str] = field(default_factory=list)
    reason: str = ""

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    def member(self, node: str) -> Member | None:
        return next((m for m in self.members if m.node == node), None)


@dataclass
class NodeRecord(Record):
    """A node agent's registration (leased: it disappears with the agent)."""

    host: str
    address: str
    slots: int
    pid: int
    worker_pids: list[int]
    started: float
    labels: dict[str, str] = field(default_factory=dict)
    #: ``host:port`` of the agent's liveness port (None when it has none)
    liveness: str | None = None
    #: the recovery tier the agent runs its workers in (``in_process``, ``restart``;
    #: empty from agents older than the restart tier)
    recovery: str = ""
    #: restart tier: the generation whose workers the agent has started (0: none yet)
    generation: int = 0
    #: restart tier: when it started them (wall-clock seconds)
    launched_at: float | None = None
    #: restart tier: when every worker of ``generation`` on the node first showed
    #: progress (its first line of output), wall-clock seconds; 0 while one has not
    #: yet; None from agents that do not report it (the launch then ends a recovery)
    progress_at: float | None = None
    #: restart tier: where the script's own checkpoint is as this agent sees it
    #: (``host:path``, :func:`orchestrator.checkpoint_root.reach.script_storage`); None
    #: when every node reads it (object storage, a shared filesystem) or it cannot
    #: be told
    script_storage: str | None = None


@dataclass
class Telemetry(Record):
    """What a worker measured about itself (see :mod:`agents.runtime.telemetry`)."""

    generation: int = 0
    group_formed_at: float | None = None
    restored_at: float | None = None
    restored_step: int | None = None
    first_step_at: float | None = None
    checkpoint_blocking_s: float | None = None
    checkpoint_upload_s: float | None = None
    #: running total of the seconds checkpoint saves blocked this process's training
    #: loop between its first and its latest completed step (failed saves included)
    checkpoint_stall_s: float = 0.0
    wire_bytes: int = 0
    dense_bytes: int = 0
    #: what ended the worker's last failed generation: error, timeout or abort
    left_by: str | None = None
    #: a sharded model's state came from: twin, peer, buddy, snapshot, live, durable, initial
    restored_from: str | None = None
    #: completed steps the generation had to train again (state restored from an older step)
    steps_lost: int = 0
    #: running totals of this rank's step time: computing, and waiting in the final
    #: gradient reduction for its peers, over ``timed_steps`` steps
    #: (:mod:`agents.runtime.step_timing`)
    compute_s: float = 0.0
    wait_s: float = 0.0
    timed_steps: int = 0
    #: a delayed sync (``sync.mode`` diloco, streaming_diloco): outer steps its site
    #: took (all fragments), bytes its site's leader received from the other sites,
    #: seconds it waited for outer results, the steps complete at its last outer step,
    #: and the outer steps its site took without its own pseudo-gradient (it reached
    #: the round after the others went ahead: ``sync.quorum``)
    outer_steps: int = 0
    site_bytes: int = 0
    outer_wait_s: float = 0.0
    last_outer_sync: int = 0
    outer_left_out: int = 0


@dataclass
class ProgressRecord(Record):
    """A worker's heartbeat: where it is, and when it last beat and last stepped."""

    step: int
    generation: int
    rank: int
    world_size: int
    pid: int
    #: wall-clock time of this beat (``time.time()``)
    beat: float
    #: wall-clock time the step counter last moved
    step_time: float
    recoveries: int = 0
    last_recovery_s: float | None = None
    paused: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    telemetry: Telemetry = field(default_factory=Telemetry)
    #: ``[step, wall-clock time it started]`` of a checkpoint save still uploading, if any
    uploading: tuple[int, float] | None = None


@dataclass
class NodeProgressRecord(Record):
    """A node's workers' heartbeats, written by its agent (one write for all of them).

    Each worker's record is its own, beat time included: the agent relays what
    its workers sent (:mod:`agents.node.progress_relay`) and never refreshes a beat,
    so a frozen worker's time goes stale in here as it would in its own record.
    """

    #: wall-clock time the agent wrote the record
    at: float
    #: worker id (``<node>-<local rank>``) → its latest progress
    workers: dict[str, ProgressRecord] = field(default_factory=dict)


@dataclass
class BreakReport(Record):
    """A worker saw its generation end (a peer is gone, or a planned switch)."""

    step: int
    reason: str
    planned: bool
    at: float
    #: the step raised an error of the script's own (not a peer's failure): the
    #: worker exits with it, and the controller restarts or fails the job
    user_error: bool = False
    #: the worker ended on a fault of its checkpoints, not of the script (``storage``:
    #: ``checkpoint.url`` cannot be written or read, or too many saves failed in a
    #: row; ``checkpoint``: the checkpoint to resume from cannot be used): the
    #: controller fails the job at once with ``reason``, as a restart meets it again
    fault: str = ""
    #: the generation's sites differ in size while its model is sharded in each site
    #: (FSDP2 under a delayed sync): the controller leaves nodes out so that the sites
    #: are of one size, in that generation and every one after it
    unequal_sites: bool = False


@dataclass
class NodeBreakReports(Record):
    """A node's workers' reports that one generation broke, written by its agent.

    At a crash every survivor reports: one write per node instead of one per
    worker (:mod:`agents.node.break_reports`).  A worker whose agent does not take
    its report writes its own :class:`BreakReport` under ``reports/``.
    """

    #: wall-clock time the agent wrote the record
    at: float
    #: worker id (``<node>-<local rank>``) → its report
    workers: dict[str, BreakReport] = field(default_factory=dict)


@dataclass
class DoneRecord(Record):
    """A worker finished its training loop."""

    step: int
    generation: int
    at: float


@dataclass
class ControlRecord(Record):
    """Requests to the workers, agreed on by every rank at one step boundary."""

    #: grows by one for each requested checkpoint
    checkpoint: int = 0
    stop: bool = False


@dataclass
class CommandRecord(Record):
    """A user's command to the controller (``stop``, ``checkpoint``)."""

    command: str
    args: dict[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.time)


@dataclass
class AgentCommand(Record):
    """The controller's command to one node agent (``kill-worker``, ``stop``)."""

    command: str
    local_rank: int = -1
    #: the process the command is about: a restarted worker is never its target
    pid: int | None = None
    reason: str = ""


@dataclass
class ResumeRequest(Record):
    """Where a resubmitted job's workers take their first state from.

    Attributes:
        url: a committed checkpoint directory.
        step: its step (for messages).
        world_size: ranks that saved it (the job may run at another size).
        newest: it was picked as a root's newest (``--resume``, ``--from ROOT``), not
            named: when it fails verification, the newest one that verifies serves.
    """

    url: str
    step: int
    world_size: int
    newest: bool = False


@dataclass
class SpecRecord(Record):
    """A submitted job: its spec (as plain data), its hash, its run and resume point."""

    spec: dict[str, Any]
    hash: str
    submitted_at: float
    resume: ResumeRequest | None = None
    #: which run of the job this is: 1 for the first submit, one more per resubmit
    run: int = 1


@dataclass
class RunRecord(Record):
    """One run of a job: when it was submitted and the checkpoint it resumed from."""

    run: int
    submitted_at: float
    resume: ResumeRequest | None = None


@dataclass
class TrainingTime(Record):
    """Where a run's wall time went, in seconds (the one definition:
    :func:`orchestrator.observe.training_time.training_time`).

    ``startup_s + productive_s + failures_s + checkpoint_s + other_s == wall_s``, and
    ``wall_s - startup_s == since_first_step_s``.

    Attributes:
        wall_s: from the run's submission to its end (or now, while it runs).
        startup_s: from the submission to the first completed step.
        since_first_step_s: from the first completed step to the end.
        productive_s: the steps gained since the first step, each at the fault-free
            step time ``step_s``.
        failures_s: lost to failures: ``recovering_s`` (each failure to the first
            step of the generation that replaced it) plus ``rerun_s`` (steps
            trained again, at ``step_s`` each).
        checkpoint_s: checkpoint saves that blocked the training loop.
        other_s: the rest: mostly after the latest step (a stop's save, the
            workers exiting, the controller seeing the end).
        effective: ``productive_s / since_first_step_s`` (effective training).
        whole_run: ``productive_s / wall_s``.
        step_s: the fault-free step time (stepping time over steps trained).
    """

    wall_s: float = 0.0
    startup_s: float = 0.0
    since_first_step_s: float = 0.0
    productive_s: float = 0.0
    failures_s: float = 0.0
    recovering_s: float = 0.0
    rerun_s: float = 0.0
    checkpoint_s: float = 0.0
    other_s: float = 0.0
    effective: float = 0.0
    whole_run: float = 0.0
    step_s: float = 0.0


@dataclass
class JobStatus(Record):
    """What the controller reports about a job (``/ringmaster/jobs/<job>/status``)."""

    name: str
    phase: JobPhase = JobPhase.PENDING
    #: the run of the job this status is about (see :class:`RunRecord`)
    run: int = 1
    step: int = 0
    world_size: int = 0
    generation: int = 0
    active_nodes: list[str] = field(default_factory=list)
    spare_nodes: list[str] = field(default_factory=list)
    failed_nodes: list[str] = field(default_factory=list)
    recoveries: int = 0
    last_checkpoint: str | None = None
    last_checkpoint_at: float | None = None
    #: ``[step, wall-clock time it started]`` of the oldest save still uploading, if any
    uploading: tuple[int, float] | None = None
    message: str = ""
    #: when what it says last changed
    updated_at: float = 0.0
    #: when a controller leading the job last wrote it (at least every few seconds while
    #: the job is not over; the submit's time until one did): how long nobody decided
    led_at: float = 0.0
    # observability (orchestrator.observe.job_observer)
    steps_per_s: float = 0.0
    samples_per_s: float | None = None
    loss: float | None = None
    submitted_at: float = 0.0
    train_started_at: float | None = None
    last_step_at: float | None = None
    finished_at: float | None = None
    #: ``training_time.productive_s`` and ``training_time.effective`` (kept for scripts)
    productive_s: float = 0.0
    effective_fraction: float = 0.0
    #: where the run's wall time went: start-up, productive, failures, checkpoint stalls
    training_time: TrainingTime | None = None
    last_recovery: dict[str, Any] | None = None
    #: how the job recovers (``in_process`` or ``restart``; empty until known): in
    #: the restart tier the script reports no steps, so ``step`` stays 0
    recovery: str = ""
    #: a delayed sync: ``sync.mode`` and what rank 0 says of the outer loop (its
    #: :class:`Telemetry` fields ``outer_steps``, ``site_bytes``, ``outer_wait_s``,
    #: ``last_outer_sync``), and the sites' bytes per inner step
    sync: dict[str, Any] = field(default_factory=dict)
    #: nodes called stragglers now → how many times as long as their peers they
    #: compute per step (:mod:`orchestrator.controller.stragglers`)
    stragglers: dict[str, float] = field(default_factory=dict)
    #: nodes swapped out for being slow: not spares until their agent restarts or an
    #: operator releases them (``ringmaster release``)
    quarantined: list[str] = field(default_factory=list)


@dataclass
class Event(Record):
    """One entry of a job's event log."""

    type: str
    message: str
    time: float = field(default_factory=time.time)
    source: str = "controller"
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class LogChunk(Record):
    """Lines of one worker's output: ``(wall time, text)`` pairs."""

    node: str
    local_rank: int
    lines: list[tuple[float, str]]
