"""The observers' records: the job over time, and one record per recovery.

The controller's observer (:mod:`orchestrator.observe.job_observer`) appends a
:class:`HistorySample` under ``history/<ns>`` now and then, and writes one
:class:`RecoveryRecord` under ``recoveries/<run>-<gen>`` for each recovery, with
the phase boundaries :mod:`orchestrator.observe.recoveries` works out.  Like
every stored value they are :class:`~orchestrator.state.codec.Record` s
(JSON with a format version, checked on read).  Written in the controller,
read by the CLI (``status``, ``report``) and the metrics endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.state.codec import Record

__all__ = ["PHASES", "HistorySample", "RecoveryRecord"]


@dataclass
class HistorySample(Record):
    """The job at one moment.

    Attributes:
        time: wall-clock seconds.
        step: highest step completed.
        steps_per_s: recent training rate.
        samples_per_s: recent throughput in samples (None when workers do
            not report ``samples``).
        loss: rank 0's last reported loss (None when the script reports none).
        phase: the job phase.
        world_size: ranks training.
    """

    time: float
    step: int
    steps_per_s: float
    samples_per_s: float | None
    loss: float | None
    phase: str
    world_size: int


#: The recovery phases, in order (see :mod:`orchestrator.observe.recoveries`).
PHASES = ("detect", "rendezvous", "restore", "first_step")


@dataclass
class RecoveryRecord(Record):
    """One recovery, as stored under ``/ringmaster/jobs/<job>/recoveries/<gen>``.

    Attributes:
        generation: the generation that trains again.
        cause: a ``FailureCause`` value.
        nodes: the nodes declared failed.
        reason: the controller's one-line explanation.
        failure_at, declared_at, group_formed_at, restored_at, first_step_at:
            the phase boundaries (wall-clock seconds), already clamped.
        step: the step that was running when the generation broke.
        restored_step: the step the new generation started from.
        observed_s: the controller's own measurement, from the failure to the
            moment it saw every worker of the new generation past ``step``.
        workers: worker id → telemetry of the few workers that were the last to
            reach a phase boundary (the ones that set the phases), not every
            worker: the record stays small at any scale
            (``orchestrator.observe.recoveries.SLOWEST_KEPT`` per boundary).
        worker_count: workers of the new generation whose telemetry was counted.
        restored_from: where the sharded state came from, over all workers
            (``+``-joined where they differ; empty for a model that is not sharded).
        most_steps_lost: the most completed steps any worker lost.
        spare_wait_s: of the ``detect`` phase, the seconds the replacement waited
            for a spare (one still starting, or none yet) before the controller
            could declare it: not time spent noticing the failure.
    """

    generation: int
    cause: str
    nodes: list[str]
    reason: str
    failure_at: float
    declared_at: float
    group_formed_at: float
    restored_at: float
    first_step_at: float
    step: int = 0
    restored_step: int = 0
    observed_s: float = 0.0
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the run of the job it happened in
    run: int = 1
    #: what ended the survivors' failed step: ``error`` (a collective raised),
    #: ``timeout``, ``abort``, joined by ``+`` when workers differ; empty when none
    #: of them was in a step (a planned change, a replacement only)
    ended_by: str = ""
    worker_count: int = 0
    restored_from: str = ""
    most_steps_lost: int = 0
    spare_wait_s: float = 0.0

    @property
    def phases(self) -> dict[str, float]:
        """Seconds spent in each of :data:`PHASES`."""
        bounds = [
            self.failure_at,
            self.declared_at,
            self.group_formed_at,
            self.restored_at,
            self.first_step_at,
        ]
        return {name: bounds[i + 1] - bounds[i] for i, name in enumerate(PHASES)}

    @property
    def total_s(self) -> float:
        return self.first_step_at - self.failure_at

    @property
    def source(self) -> str:
        """Where the sharded state of the generation came from (``+``-joined where workers
        differ; empty for a model that is not sharded)."""
        if self.restored_from:
            return self.restored_from
        # a record written before the summary fields kept every worker's telemetry
        found = {str(t["restored_from"]) for t in self.workers.values() if t.get("restored_from")}
        return "+".join(sorted(found))

    @property
    def steps_lost(self) -> int:
        """Completed steps lost, as the workers of a sharded model counted them; from a
        durable checkpoint at least the steps between it and the step that broke (no
        worker that held them is left to count them when a whole replica went)."""
        kept = [int(t.get("steps_lost") or 0) for t in self.workers.values()]
        durable = self.steps_rerun if "durable" in self.source.split("+") else 0
        return max([self.most_steps_lost, *kept, durable])

    @property
    def steps_rerun(self) -> int:
        """Completed steps that had to be trained again (restored from an older state)."""
        return max(0, self.step - self.restored_step)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["phases"] = {k: round(v, 6) for k, v in self.phases.items()}
        out["total_s"] = round(self.total_s, 6)
        if self.source:
            out["source"] = self.source
            out["steps_lost"] = self.steps_lost
        return out
