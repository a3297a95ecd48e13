"""What the controller observes about a job, beyond deciding who trains.

:class:`JobObserver` is fed by :class:`~orchestrator.controller.job.JobController`
on every tick and at the moments that matter (a failure seen, a failure
declared, a recovery finished, a checkpoint committed).  From that it keeps
the job status's observability fields (rate, throughput, loss, where the
wall time went and the effective training time
(:mod:`orchestrator.observe.training_time`), the last recovery), appends the sampled history
(:mod:`orchestrator.observe.history`), records membership changes and recoveries as
events, stores recovery records, and updates the Prometheus metrics
(:mod:`orchestrator.observe.metrics`) when the controller serves them.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from datetime import timedelta
from typing import Any

from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.history import HistoryWriter
from orchestrator.observe.metrics import JobMetrics
from orchestrator.observe.records import HistorySample, RecoveryRecord
from orchestrator.observe.recoveries import (
    FailureCause,
    build_record,
    classify_cause,
    recovered_message,
)
from orchestrator.observe.training_time import training_time
from orchestrator.observe.units import size_text
from orchestrator.state import events, keys, records
from orchestrator.state.records import (
    BreakReport,
    JobStatus,
    NodeRecord,
    Plan,
    ProgressRecord,
    SpecRecord,
    Telemetry,
    TrainingTime,
)

#: Steps per second are measured over this trailing window.
RATE_WINDOW = timedelta(seconds=3)
#: Events this long before a failure are considered when finding its cause.
CAUSE_LOOKBACK = timedelta(seconds=60)


class _Pending:
    """A recovery in progress."""

    def __init__(self, failure_at: float, step: int) -> None:
        self.failure_at = failure_at
        self.step = step
        self.declared_at: float | None = None
        #: of the time to the declaration, seconds spent waiting for a spare
        self.spare_wait_s = 0.0
        self.nodes: set[str] = set()
        self.cause: str | None = None
        self.reason = ""
        #: whether ``step`` came from a report of the break (not a heartbeat's step)
        self.reported = False


class JobObserver:
    """Observability state of one job (see the module docstring)."""

    def __init__(self, client: EtcdClient, job: str, metrics: JobMetrics | None) -> None:
        self.client = client
        self.job = job
        self.metrics = metrics
        self.history = HistoryWriter(client, job)
        self._rates: collections.deque[tuple[float, int]] = collections.deque()
        self._known_nodes: set[str] | None = None
        self._pending: _Pending | None = None
        self._start_step = 0
        spec = records.read(client, keys.job_spec(job), SpecRecord)
        self.submitted_at = spec.submitted_at if spec is not None else time.time()
        #: the run observed: recoveries of earlier runs are theirs, not this run's
        self.run = spec.run if spec is not None else 1
        self.recoveries: list[RecoveryRecord] = [
            r
            for r in records.read_all(client, keys.job_recoveries(job), RecoveryRecord).values()
            if r.run == self.run
        ]
        #: seconds checkpoint saves blocked the run's rank 0 (between its steps), summed
        #: over the processes that were rank 0: each one's increases while it was
        self.checkpoint_stall_s = 0.0
        #: (worker, pid) → its running stall total when last seen
        self._stalls_seen: dict[tuple[str, int], float] = {}
        #: a controller that took over a running job: what its first look finds was
        #: counted by the one before
        self._took_over = False

    def adopt(self, status: JobStatus) -> None:
        """A controller takes over a started job whose last status is ``status``.

        The nodes that status named are the ones known, so a node that went
        (a spare's agent killed, say) or came while no controller led the job
        is still told, as a ``NodeLost`` or ``NodeRegistered`` event.
        """
        if status.phase is not JobPhase.PENDING:
            self._known_nodes = set(status.active_nodes) | set(status.spare_nodes)
            self._took_over = True
            if status.run == self.run and status.training_time is not None:
                self.checkpoint_stall_s = status.training_time.checkpoint_s

    # -- every tick --------------------------------------------------------------------

    def observe(
        self,
        status: JobStatus,
        plan: Plan | None,
        nodes: dict[str, NodeRecord],
        progress: dict[str, ProgressRecord],
    ) -> None:
        now = time.time()
        status.submitted_at = status.submitted_at or self.submitted_at
        self._membership(status, nodes)
        workers = self._plan_workers(plan, progress)
        if self.metrics is not None:
            for w, p in progress.items():
                self.metrics.worker_telemetry(self.job, w, p.pid, p.telemetry)
        if workers and status.train_started_at is None:
            firsts = [
                (p.telemetry.first_step_at, p.telemetry.restored_step or 0)
                for p in workers.values()
                if p.telemetry.first_step_at
            ]
            if firsts:
                status.train_started_at, self._start_step = min(firsts)
        if workers and status.train_started_at is not None:
            status.last_step_at = max(p.step_time for p in workers.values())
        self._rate(status, now)
        samples = [p.metrics["samples"] for p in workers.values() if "samples" in p.metrics]
        status.samples_per_s = (
            round(status.steps_per_s * sum(samples), 3) if samples else status.samples_per_s
        )
        rank0 = next((p for p in workers.values() if p.rank == 0), None)
        if rank0 is not None:
            status.loss = rank0.metrics.get("loss")
            if rank0.telemetry.outer_steps or rank0.telemetry.site_bytes:
                status.sync = outer_loop(rank0.telemetry, list(workers.values()), status.step)
        uploads = [p.uploading for p in workers.values() if p.uploading is not None]
        status.uploading = min(uploads, key=lambda u: u[1]) if uploads else None
        if status.phase.terminal and status.finished_at is None:
            status.finished_at = now
        self._count_stalls(workers, progress)
        end = status.finished_at or now
        split = training_time(
            submitted_at=status.submitted_at,
            train_started_at=status.train_started_at,
            last_step_at=status.last_step_at,
            end=end,
            steps=max(0, status.step - self._start_step - 1),
            recoveries=self.recoveries,
            checkpoint_stall_s=self.checkpoint_stall_s,
            failing_since=self._pending.failure_at if self._pending is not None else None,
        )
        status.training_time = _rounded(split)
        status.productive_s = status.training_time.productive_s
        status.effective_fraction = round(split.effective, 4)
        if plan is not None and not status.phase.terminal and self.history.due():
            self.history.append(
                HistorySample(
                    time=now,
                    step=status.step,
                    steps_per_s=status.steps_per_s,
                    samples_per_s=status.samples_per_s,
                    loss=status.loss,
                    phase=status.phase.value,
                    world_size=status.world_size,
                )
            )
        if self.metrics is not None:
            tel = _rank0_telemetry(progress)
            self.metrics.checkpoint_times(
                self.job, tel.checkpoint_blocking_s, tel.checkpoint_upload_s
            )
            self.metrics.job_state(
                self.job,
                phase=status.phase,
                run=status.run,
                step=status.step,
                steps_per_s=status.steps_per_s,
                samples_per_s=status.samples_per_s,
                world_size=status.world_size,
                active=len(status.active_nodes),
                spares=len(status.spare_nodes),
                failed=len(status.failed_nodes),
                effective_ratio=split.effective,
                productive_s=split.productive_s,
            )
            self.metrics.training_time(self.job, split)

    def _count_stalls(
        self, workers: dict[str, ProgressRecord], progress: dict[str, ProgressRecord]
    ) -> None:
        """Add what the rank 0 of the plan's workers stalled on saves since the last look.

        Every process's running total is remembered, so one that becomes rank 0
        (its predecessor gone) adds only what it stalls from then on; one first
        seen starts from zero, except at a takeover's first look (the controller
        before counted it).
        """
        base_only = self._took_over and not self._stalls_seen
        for w, p in progress.items():
            key = (w, p.pid)
            total = p.telemetry.checkpoint_stall_s
            before = self._stalls_seen.get(key, total if base_only else 0.0)
            if total > before and p.rank == 0 and workers.get(w) is p:
                self.checkpoint_stall_s += total - before
            self._stalls_seen[key] = max(total, before)

    def _plan_workers(
        self, plan: Plan | None, progress: dict[str, ProgressRecord]
    ) -> dict[str, ProgressRecord]:
        if plan is None:
            return {}
        out = {}
        for m in plan.members:
            for i in range(m.nproc):
                w = keys.worker_id(m.node, i)
                p = progress.get(w)
                if p is not None and p.generation == plan.generation:
                    out[w] = p
        return out

    def _rate(self, status: JobStatus, now: float) -> None:
        if status.phase.terminal:
            status.steps_per_s = 0.0
            return
        self._rates.append((now, status.step))
        while self._rates and now - self._rates[0][0] > RATE_WINDOW.total_seconds():
            self._rates.popleft()
        t0, s0 = self._rates[0]
        if now - t0 >= 0.5:
            status.steps_per_s = round(max(0, status.step - s0) / (now - t0), 3)

    def _membership(self, status: JobStatus, nodes: dict[str, NodeRecord]) -> None:
        current = set(nodes)
        if self._known_nodes is None:
            # A standby that takes over adopts what it finds; only a fresh job logs arrivals.
            self._known_nodes = set() if status.phase is JobPhase.PENDING else current
        for node in sorted(current - self._known_nodes):
            labels = ",".join(f"{k}={v}" for k, v in sorted(nodes[node].labels.items()))
            events.emit(
                self.client, self.job, "NodeRegistered", f"{node} registered ({labels})", node=node
            )
        for node in sorted(self._known_nodes - current):
            events.emit(
                self.client,
                self.job,
                "NodeLost",
                f"{node}: registration gone (lease expired or revoked)",
                node=node,
            )
        self._known_nodes = current

    # -- moments -----------------------------------------------------------------------

    def failure_seen(self, reports: dict[str, BreakReport], step: int) -> None:
        """Workers reported a broken generation (called once per break)."""
        at = min((r.at for r in reports.values()), default=time.time())
        if self._pending is None:
            self._pending = _Pending(at, step)
            self._pending.reported = True

    def unreported(self) -> bool:
        """Whether the recovery under way was declared before any worker reported the
        break (an agent's watch closed): its step is only the last heartbeat's."""
        return self._pending is not None and not self._pending.reported

    def declared(
        self,
        failed: set[str],
        why: str,
        nodes: dict[str, Any],
        step: int,
        agent_gone: set[str] | None = None,
        at: float | None = None,
        seen_at: float | None = None,
        spare_wait_s: float = 0.0,
    ) -> str:
        """The controller replaces ``failed`` (decided at ``at``, wall-clock; default now;
        the failure seen at ``seen_at``, if before; after waiting ``spare_wait_s`` for a
        spare); returns the failure cause."""
        now = time.time() if at is None else at
        if self._pending is None:
            self._pending = _Pending(now, step)
        pending = self._pending
        if seen_at is not None:
            pending.failure_at = min(pending.failure_at, seen_at)
        if pending.declared_at is None:
            pending.declared_at = now
            pending.spare_wait_s = spare_wait_s
        since = pending.failure_at - CAUSE_LOOKBACK.total_seconds()
        recent = [e for e in events.list_events(self.client, self.job) if e.time >= since]
        cause = classify_cause(failed, recent, nodes, agent_gone or set())
        if cause is FailureCause.HANG:
            # the hang began with the hung worker's last heartbeat
            froze = [
                float(e.data["silent_since"])
                for e in recent
                if e.type == "WorkerHung" and e.data.get("silent_since")
            ]
            if froze:
                pending.failure_at = min(pending.failure_at, min(froze))
        if pending.cause is None:
            pending.cause = cause.value
            pending.reason = why
        pending.nodes |= failed
        return cause.value

    def recovered(
        self,
        status: JobStatus,
        plan: Plan,
        progress: dict[str, ProgressRecord],
        broke_at: int | None = None,
    ) -> RecoveryRecord | None:
        """Every worker of ``plan`` trains again: store the recovery's record.

        Args:
            broke_at: for a recovery declared before any report (:meth:`unreported`),
                the step the replaced generation's survivors reported breaking at.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if not pending.reported and broke_at is not None:
            pending.step = broke_at
        workers = {
            w: dataclasses.asdict(p.telemetry)
            for w, p in self._plan_workers(plan, progress).items()
            if p.telemetry.generation == plan.generation
        }
        now = time.time()
        record = build_record(
            generation=plan.generation,
            cause=pending.cause or FailureCause.UNRESPONSIVE.value,
            nodes=sorted(pending.nodes),
            reason=pending.reason,
            failure_at=pending.failure_at,
            declared_at=pending.declared_at or now,
            spare_wait_s=pending.spare_wait_s,
            workers=workers,
            step=pending.step,
            observed_s=now - pending.failure_at,
        )
        record.run = self.run
        records.write(self.client, keys.job_recovery(self.job, self.run, plan.generation), record)
        self.client.keep_newest(
            keys.job_recoveries(self.job), keys.RECOVERIES_KEPT, keys.RECOVERIES_KEPT // 10
        )
        self.recoveries.append(record)
        phases = record.phases
        status.last_recovery = {
            "generation": record.generation,
            "cause": record.cause,
            "total_s": round(record.total_s, 3),
            "phases": {k: round(v, 3) for k, v in phases.items()},
            **({"spare_wait_s": round(record.spare_wait_s, 3)} if record.spare_wait_s else {}),
        }
        events.emit(
            self.client,
            self.job,
            "Recovered",
            recovered_message(record, status.recovery == "restart")
            + (f"; the failed step ended by {record.ended_by}" if record.ended_by else "")
            + _sharded_state(record),
            generation=plan.generation,
            cause=record.cause,
            ended_by=record.ended_by,
            **(
                {"restored_from": record.source, "steps_lost": record.steps_lost}
                if record.source
                else {}
            ),
            total_s=round(record.total_s, 6),
            phases={k: round(v, 6) for k, v in phases.items()},
            **({"spare_wait_s": round(record.spare_wait_s, 6)} if record.spare_wait_s else {}),
        )
        if self.metrics is not None:
            self.metrics.recovery(self.job, record)
        return record

    def checkpoint(self, progress: dict[str, ProgressRecord]) -> dict[str, Any]:
        """A checkpoint was committed: its timings (from rank 0) for the event."""
        tel = _rank0_telemetry(progress)
        blocking, upload = tel.checkpoint_blocking_s, tel.checkpoint_upload_s
        if self.metrics is not None:
            self.metrics.checkpoint(self.job, blocking, upload)
        return {"blocking_s": blocking, "upload_s": upload}


def _rounded(split: TrainingTime) -> TrainingTime:
    """``split`` as the status keeps it: milliseconds, and fractions to 4 places."""
    out = {k: round(v, 3) for k, v in dataclasses.asdict(split).items()}
    out["effective"] = round(split.effective, 4)
    out["whole_run"] = round(split.whole_run, 4)
    out["step_s"] = round(split.step_s, 6)
    return TrainingTime(**out)


def _rank0_telemetry(progress: dict[str, ProgressRecord]) -> Telemetry:
    """Telemetry of the newest generation's rank 0 (it saves and records checkpoints)."""
    rank0 = [p for p in progress.values() if p.rank == 0]
    if not rank0:
        return Telemetry()
    return max(rank0, key=lambda p: p.generation).telemetry


def _sharded_state(record: RecoveryRecord) -> str:
    """``; state from <source>, <n> steps lost`` for a sharded model, else nothing."""
    if not record.source:
        return ""
    lost = record.steps_lost
    return f"; state from {record.source}, {lost} step{'' if lost == 1 else 's'} lost"


def outer_loop(rank0: Telemetry, workers: list[ProgressRecord], step: int) -> dict[str, Any]:
    """What ``status`` says of a delayed sync: rank 0's outer loop, and the bytes every
    site's leader received from the others (each crossing counted once), per step, and
    the most outer steps a site took without its own pseudo-gradient."""
    between = sum(p.telemetry.site_bytes for p in workers)
    return {
        "left_out": max((p.telemetry.outer_left_out for p in workers), default=0),
        "outer_steps": rank0.outer_steps,
        "last_outer_sync": rank0.last_outer_sync,
        "outer_wait_s": round(rank0.outer_wait_s, 3),
        "site_bytes": between,
        "site_bytes_per_step": round(between / step) if step else 0,
    }


def outer_loop_text(sync: dict[str, Any]) -> str:
    """A delayed sync's outer loop in a line (``JobStatus.sync``, see :func:`outer_loop`)."""
    return (
        f"{sync['outer_steps']} outer steps, the last at step {sync['last_outer_sync']}; "
        f"{size_text(sync['site_bytes'])} between sites "
        f"({size_text(sync['site_bytes_per_step'])}/step); "
        f"rank 0 waited {sync['outer_wait_s']:.1f}s for outer results"
        + (f"; a site was left out of {sync['left_out']}" if sync.get("left_out") else "")
    )
