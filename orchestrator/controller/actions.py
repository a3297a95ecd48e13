"""What the controller's policy asks for: one small record per kind of side effect.

The policy (:mod:`orchestrator.controller.policy`) returns a list of these;
the executor (:mod:`orchestrator.controller.job`) applies them, in order, to
etcd, the event log and the observer.  Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.api import JobPhase
from orchestrator.state.records import (
    AgentCommand,
    BreakReport,
    CheckpointRecord,
    ControlRecord,
    Plan,
)


@dataclass(frozen=True)
class PublishPlan:
    """Write the next generation (members in rank order, spares)."""

    plan: Plan


@dataclass(frozen=True)
class PhaseChanged:
    """The job moved to ``phase``: record the event and write the status now."""

    phase: JobPhase
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Emit:
    """Append an event to the job's log."""

    type: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReleaseNode:
    """An operator let a quarantined node be a spare again (no I/O: the controller's
    straggler decisions apply it, :mod:`orchestrator.controller.straggler_swaps`)."""

    node: str


@dataclass(frozen=True)
class FailureSeen:
    """Workers reported the generation broken: the observer starts timing a recovery."""

    reports: dict[str, BreakReport]
    step: int


@dataclass(frozen=True)
class DeclareFailed:
    """Nodes are declared failed (the observer classifies the cause for the events)."""

    nodes: frozenset[str]
    why: str
    step: int
    agent_gone: frozenset[str] = frozenset()
    #: when the failure was seen (wall clock), where that was before the deciding tick
    seen_at: float | None = None
    #: seconds the replacement waited for a spare (still starting, or none yet) before
    #: this declaration: part of the time to declare, reported apart from detection
    spare_wait_s: float = 0.0


@dataclass(frozen=True)
class Recovered:
    """Every worker of ``plan`` trains again: the observer stores the recovery record."""

    plan: Plan


@dataclass(frozen=True)
class CheckpointCommitted:
    """A new checkpoint record appeared: emit its event with rank 0's timings.

    ``late``: a commit made while no controller led the job, found in the
    record's earlier commits; its event says so and has no timings.
    """

    record: CheckpointRecord
    late: bool = False


@dataclass(frozen=True)
class KillWorker:
    """Tell a node's agent to kill one (hung) worker process."""

    node: str
    command: AgentCommand
    worker: str
    message: str
    #: wall-clock time of its last heartbeat: when it froze
    silent_since: float = 0.0


@dataclass(frozen=True)
class WriteControl:
    """Replace the control record the workers agree on at step boundaries."""

    control: ControlRecord


@dataclass(frozen=True)
class ProbeLinks:
    """Ask the nodes' agents to measure their links to each other, in the background
    (:mod:`orchestrator.ports.link_probe`); the result reaches the next ticks' world."""

    #: node → its agent's port (``host:port``)
    ports: dict[str, str]


@dataclass(frozen=True)
class DeleteCommand:
    """A user's command was taken: remove it."""

    key: str


Action = (
    PublishPlan
    | PhaseChanged
    | Emit
    | FailureSeen
    | DeclareFailed
    | Recovered
    | CheckpointCommitted
    | KillWorker
    | WriteControl
    | DeleteCommand
    | ReleaseNode
    | ProbeLinks
)
