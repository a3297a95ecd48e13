"""Prometheus metrics of the jobs a controller leads.

The controller already reads everything worth exporting (job status, worker
progress and telemetry, recoveries), so it is the one exporter: workers do
not open ports.  Every series carries a ``job`` label.

* ``ringmaster_job_phase`` (gauge; job, phase): 1 for the current phase
* ``ringmaster_job_step``, ``ringmaster_job_run``, ``ringmaster_job_world_size`` (gauges)
* ``ringmaster_job_steps_per_second``, ``ringmaster_job_samples_per_second`` (gauges)
* ``ringmaster_job_nodes`` (gauge; job, state = active/spare/failed) and
  ``ringmaster_job_spare_nodes`` (warm spares left)
* ``ringmaster_job_recoveries_total`` (counter; job, cause)
* ``ringmaster_job_recovery_seconds`` (histogram): failure → first step
* ``ringmaster_job_recovery_phase_seconds`` (histogram; job, phase) and
  ``ringmaster_job_last_recovery_phase_seconds`` (gauge; job, phase), for
  detect / rendezvous / restore / first_step
* ``ringmaster_job_checkpoint_blocking_seconds``,
  ``ringmaster_job_checkpoint_upload_seconds`` (gauges, last save) and
  ``ringmaster_job_checkpoints_total`` (counter)
* ``ringmaster_job_comm_wire_bytes_total``, ``ringmaster_job_comm_dense_bytes_total``
  (counters: gradient bytes sent, and the fp32 bytes they stand for) and
  ``ringmaster_job_comm_compression_ratio`` (gauge, dense / wire)
* ``ringmaster_job_effective_training_ratio``, ``ringmaster_job_productive_seconds``
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from orchestrator.api import JobPhase, OrchestratorError
from orchestrator.records import PHASES, RecoveryRecord, Telemetry

log = logging.getLogger("ringmaster.metrics")


class MetricsServerError(OrchestratorError):
    """The metrics endpoint could not be served (port taken, address not local)."""


_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class JobMetrics:
    """The metric families, in a registry of their own (one per controller)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.phase = Gauge(
            "ringmaster_job_phase", "1 for the job's current phase", ["job", "phase"], registry=r
        )
        self.step = Gauge("ringmaster_job_step", "Highest completed step", ["job"], registry=r)
        self.run = Gauge(
            "ringmaster_job_run", "The job's current run (1, then one more per resubmit)",
            ["job"], registry=r,
        )  # fmt: skip
        self.steps_per_second = Gauge(
            "ringmaster_job_steps_per_second", "Recent training rate", ["job"], registry=r
        )
        self.samples_per_second = Gauge(
            "ringmaster_job_samples_per_second",
            "Recent throughput (samples the workers report per step)",
            ["job"],
            registry=r,
        )
        self.world_size = Gauge("ringmaster_job_world_size", "Ranks training", ["job"], registry=r)
        self.nodes = Gauge("ringmaster_job_nodes", "Nodes by state", ["job", "state"], registry=r)
        self.spares = Gauge("ringmaster_job_spare_nodes", "Warm spares left", ["job"], registry=r)
        self.recoveries = Counter(
            "ringmaster_job_recoveries", "Recoveries by failure cause", ["job", "cause"], registry=r
        )
        self.recovery_seconds = Histogram(
            "ringmaster_job_recovery_seconds",
            "Failure to the first completed step of the new generation",
            ["job"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.recovery_phase_seconds = Histogram(
            "ringmaster_job_recovery_phase_seconds",
            "Recovery time by phase (detect, rendezvous, restore, first_step)",
            ["job", "phase"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.last_recovery_phase = Gauge(
            "ringmaster_job_last_recovery_phase_seconds",
            "The last recovery's time by phase",
            ["job", "phase"],
            registry=r,
        )
        self.checkpoint_blocking = Gauge(
            "ringmaster_job_checkpoint_blocking_seconds",
            "How long the last durable save blocked training",
            ["job"],
            registry=r,
        )
        self.checkpoint_upload = Gauge(
            "ringmaster_job_checkpoint_upload_seconds",
            "How long the last durable save took to upload and commit",
            ["job"],
            registry=r,
        )
        self.checkpoints = Counter(
            "ringmaster_job_checkpoints", "Committed durable checkpoints", ["job"], registry=r
        )
        self.wire_bytes = Counter(
            "ringmaster_job_comm_wire_bytes",
            "Gradient bytes the workers sent",
            ["job"],
            registry=r,
        )
        self.dense_bytes = Counter(
            "ringmaster_job_comm_dense_bytes",
            "Dense fp32 bytes the sent gradients stand for",
            ["job"],
            registry=r,
        )
        self.compression_ratio = Gauge(
            "ringmaster_job_comm_compression_ratio",
            "Dense fp32 bytes over bytes sent (1 = uncompressed)",
            ["job"],
            registry=r,
        )
        self.effective_ratio = Gauge(
            "ringmaster_job_effective_training_ratio",
            "Share of wall time spent making progress",
            ["job"],
            registry=r,
        )
        self.productive_seconds = Gauge(
            "ringmaster_job_productive_seconds",
            "Wall time spent making progress",
            ["job"],
            registry=r,
        )
        self._worker_bytes: dict[tuple[str, str], tuple[int, int]] = {}
        self._wire: dict[str, float] = {}
        self._dense: dict[str, float] = {}

    def job_state(
        self,
        job: str,
        *,
        phase: JobPhase,
        run: int,
        step: int,
        steps_per_s: float,
        samples_per_s: float | None,
        world_size: int,
        active: int,
        spares: int,
        failed: int,
        effective_ratio: float,
        productive_s: float,
    ) -> None:
        for p in JobPhase:
            self.phase.labels(job, p.value).set(1 if p is phase else 0)
        self.step.labels(job).set(step)
        self.run.labels(job).set(run)
        self.steps_per_second.labels(job).set(steps_per_s)
        if samples_per_s is not None:
            self.samples_per_second.labels(job).set(samples_per_s)
        self.world_size.labels(job).set(world_size)
        for state, count in (("active", active), ("spare", spares), ("failed", failed)):
            self.nodes.labels(job, state).set(count)
        self.spares.labels(job).set(spares)
        self.effective_ratio.labels(job).set(effective_ratio)
        self.productive_seconds.labels(job).set(productive_s)

    def worker_telemetry(self, job: str, worker: str, pid: int, telemetry: Telemetry) -> None:
        """Fold a worker's running byte totals into the job's counters.

        A restarted worker starts again from zero, so totals are tracked per
        (worker, pid) and only their increase is added.
        """
        wire, dense = telemetry.wire_bytes, telemetry.dense_bytes
        key = (job, f"{worker}/{pid}")
        old_wire, old_dense = self._worker_bytes.get(key, (0, 0))
        if wire > old_wire:
            self.wire_bytes.labels(job).inc(wire - old_wire)
            self._wire[job] = self._wire.get(job, 0.0) + wire - old_wire
        if dense > old_dense:
            self.dense_bytes.labels(job).inc(dense - old_dense)
            self._dense[job] = self._dense.get(job, 0.0) + dense - old_dense
        self._worker_bytes[key] = (max(wire, old_wire), max(dense, old_dense))
        if self._wire.get(job):
            self.compression_ratio.labels(job).set(self._dense.get(job, 0.0) / self._wire[job])

    def checkpoint(self, job: str, blocking_s: float | None, upload_s: float | None) -> None:
        self.checkpoints.labels(job).inc()
        self.checkpoint_times(job, blocking_s, upload_s)

    def checkpoint_times(self, job: str, blocking_s: float | None, upload_s: float | None) -> None:
        if blocking_s is not None:
            self.checkpoint_blocking.labels(job).set(blocking_s)
        if upload_s is not None:
            self.checkpoint_upload.labels(job).set(upload_s)

    def recovery(self, job: str, record: RecoveryRecord) -> None:
        self.recoveries.labels(job, record.cause).inc()
        self.recovery_seconds.labels(job).observe(record.total_s)
        for name in PHASES:
            seconds = record.phases[name]
            self.recovery_phase_seconds.labels(job, name).observe(seconds)
            self.last_recovery_phase.labels(job, name).set(seconds)


class MetricsServer:
    """Serves a registry over HTTP at ``/metrics`` (port 0: any free port)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._server: Any = None

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("", "0.0.0.0") else "127.0.0.1"
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> str:
        """Start serving in a daemon thread; returns the URL.

        Raises:
            MetricsServerError: the port is taken or the address cannot be bound.
        """
        try:
            server, _thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as e:
            raise MetricsServerError(
                f"cannot serve metrics on {self.host}:{self.port}: {e.strerror or e}; "
                "pick another --metrics-port (0 picks a free one)"
            ) from e
        self._server = server
        self.port = int(server.server_port)
        log.warning("metrics at %s", self.url)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
