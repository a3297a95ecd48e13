"""Prometheus metrics of the jobs a controller leads.

Over 450 lines, kept whole: one series list (below) and the one renderer that
writes each of them, in the same order; split, a series' meaning and its
value would be in different files.

The controller already reads everything worth exporting (job status, worker
progress and telemetry, recoveries), so it is the one exporter: workers do
not open ports.  Every series carries a ``ringmaster_job`` label (the job's
name).  It is not called ``job``: Prometheus gives every scraped series a
``job`` label of its own (the scrape job), which would overwrite ours or be
renamed to ``exported_job``.  Counters are exported with the ``_total`` suffix;
rates are ``rate(..._total[5m])`` of them, never of a gauge.

* ``ringmaster_job_phase`` (gauge; ringmaster_job, phase): 1 for the current phase
* ``ringmaster_job_step``, ``ringmaster_job_run``, ``ringmaster_job_world_size`` (gauges)
* ``ringmaster_job_steps_per_second``, ``ringmaster_job_samples_per_second`` (gauges, the
  controller's own recent estimate)
* ``ringmaster_job_steps_total`` (counter): steps completed while this controller led
  (a step taken again after a restore from a checkpoint counts again);
  ``rate(ringmaster_job_steps_total[5m])`` is the step rate
* ``ringmaster_job_productive_wall_seconds_total`` (counter): wall time spent making progress;
  ``rate(...)`` of it is the effective-training share over the window
* ``ringmaster_job_nodes`` (gauge; ringmaster_job, state = active/spare/failed) and
  ``ringmaster_job_spare_nodes`` (warm spares left)
* ``ringmaster_job_recoveries_total`` (counter; ringmaster_job, cause)
* ``ringmaster_job_recovery_seconds`` (histogram): failure → first step
* ``ringmaster_job_recovery_phase_seconds`` (histogram; ringmaster_job, phase) and
  ``ringmaster_job_last_recovery_phase_seconds`` (gauge; ringmaster_job, phase), for
  detect / rendezvous / restore / first_step
* ``ringmaster_job_checkpoint_blocking_seconds``,
  ``ringmaster_job_checkpoint_upload_seconds`` (gauges, last save) and
  ``ringmaster_job_checkpoints_total`` (counter)
* ``ringmaster_job_comm_wire_bytes_total``, ``ringmaster_job_comm_dense_bytes_total``
  (counters: gradient bytes sent, and the fp32 bytes they stand for) and
  ``ringmaster_job_comm_compression_ratio`` (gauge, dense / wire)
* ``ringmaster_job_site_bytes_total`` (counter: bytes the sites' leaders received
  from other sites under a delayed sync) and ``ringmaster_job_outer_steps`` (gauge:
  outer steps taken, every fragment's counted)
* ``ringmaster_node_step_compute_seconds`` and ``ringmaster_node_slowdown`` (gauges;
  ringmaster_job, node): a node's compute time per step in the last window, and
  that over its peers' median (:mod:`orchestrator.controller.stragglers`)
* ``ringmaster_link_bytes_per_second`` (gauge; ringmaster_job, sender, receiver): the
  rate the last link probe measured from one node's agent to another's
  (:mod:`orchestrator.ports.link_probe`, run when step timings point at a slow link)
* ``ringmaster_job_effective_training_ratio`` (gauge): productive time over the wall
  time since the first completed step; ``ringmaster_job_whole_run_effective_ratio``
  (gauge): productive time over the run's whole wall time; and
  ``ringmaster_job_productive_seconds`` (gauge)
* ``ringmaster_job_time_seconds`` (gauge; ringmaster_job, part = startup, productive,
  failures, checkpoint, other): where the run's wall time went, the parts adding up
  to it (:mod:`orchestrator.observe.training_time`)

And of etcd itself, read when scraped (:class:`EtcdCollector`, once the
controller calls :meth:`JobMetrics.watch_etcd`), without a job label:

* ``ringmaster_etcd_db_bytes`` (gauge): the largest member database
* ``ringmaster_etcd_quota_bytes`` (gauge): the size at which etcd refuses writes
* ``ringmaster_etcd_alarm`` (gauge; kind): 1 while an alarm of that kind is
  raised (``NOSPACE``: etcd refuses writes; always exported), else 0
* ``ringmaster_etcd_up`` (gauge): 1 when etcd answered the scrape's questions
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orchestrator.api import EtcdError, JobPhase, OrchestratorError
from orchestrator.observe.records import PHASES, RecoveryRecord
from orchestrator.observe.training_time import time_parts
from orchestrator.state.records import Telemetry, TrainingTime

if TYPE_CHECKING:
    from orchestrator.etcd.client import EtcdClient
    from orchestrator.etcd.health import EtcdHealth

log = logging.getLogger("ringmaster.metrics")


#: The label that names the job on every series (not ``job``: Prometheus' own target label).
JOB_LABEL = "ringmaster_job"


class MetricsServerError(OrchestratorError):
    """The metrics endpoint could not be served (port taken, address not local)."""


_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class JobMetrics:
    """The metric families, in a registry of their own (one per controller)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.phase = Gauge(
            "ringmaster_job_phase",
            "1 for the job's current phase",
            [JOB_LABEL, "phase"],
            registry=r,
        )
        self.step = Gauge("ringmaster_job_step", "Highest completed step", [JOB_LABEL], registry=r)
        self.run = Gauge(
            "ringmaster_job_run",
            "The job's current run (1, then one more per resubmit)",
            [JOB_LABEL],
            registry=r,
        )
        self.steps_total = Counter(
            "ringmaster_job_steps",
            "Steps completed while this controller led",
            [JOB_LABEL],
            registry=r,
        )
        self.productive_total = Counter(
            "ringmaster_job_productive_wall_seconds",
            "Wall time spent making progress (counter)",
            [JOB_LABEL],
            registry=r,
        )
        self.steps_per_second = Gauge(
            "ringmaster_job_steps_per_second", "Recent training rate", [JOB_LABEL], registry=r
        )
        self.samples_per_second = Gauge(
            "ringmaster_job_samples_per_second",
            "Recent throughput (samples the workers report per step)",
            [JOB_LABEL],
            registry=r,
        )
        self.world_size = Gauge(
            "ringmaster_job_world_size", "Ranks training", [JOB_LABEL], registry=r
        )
        self.nodes = Gauge(
            "ringmaster_job_nodes", "Nodes by state", [JOB_LABEL, "state"], registry=r
        )
        self.spares = Gauge(
            "ringmaster_job_spare_nodes", "Warm spares left", [JOB_LABEL], registry=r
        )
        self.recoveries = Counter(
            "ringmaster_job_recoveries",
            "Recoveries by failure cause",
            [JOB_LABEL, "cause"],
            registry=r,
        )
        self.recovery_seconds = Histogram(
            "ringmaster_job_recovery_seconds",
            "Failure to the first completed step of the new generation",
            [JOB_LABEL],
            buckets=_BUCKETS,
            registry=r,
        )
        self.recovery_phase_seconds = Histogram(
            "ringmaster_job_recovery_phase_seconds",
            "Recovery time by phase (detect, rendezvous, restore, first_step)",
            [JOB_LABEL, "phase"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.last_recovery_phase = Gauge(
            "ringmaster_job_last_recovery_phase_seconds",
            "The last recovery's time by phase",
            [JOB_LABEL, "phase"],
            registry=r,
        )
        self.checkpoint_blocking = Gauge(
            "ringmaster_job_checkpoint_blocking_seconds",
            "How long the last durable save blocked training",
            [JOB_LABEL],
            registry=r,
        )
        self.checkpoint_upload = Gauge(
            "ringmaster_job_checkpoint_upload_seconds",
            "How long the last durable save took to upload and commit",
            [JOB_LABEL],
            registry=r,
        )
        self.checkpoints = Counter(
            "ringmaster_job_checkpoints", "Committed durable checkpoints", [JOB_LABEL], registry=r
        )
        self.wire_bytes = Counter(
            "ringmaster_job_comm_wire_bytes",
            "Gradient bytes the workers sent",
            [JOB_LABEL],
            registry=r,
        )
        self.dense_bytes = Counter(
            "ringmaster_job_comm_dense_bytes",
            "Dense fp32 bytes the sent gradients stand for",
            [JOB_LABEL],
            registry=r,
        )
        self.compression_ratio = Gauge(
            "ringmaster_job_comm_compression_ratio",
            "Dense fp32 bytes over bytes sent (1 = uncompressed)",
            [JOB_LABEL],
            registry=r,
        )
        self.site_bytes = Counter(
            "ringmaster_job_site_bytes",
            "Bytes the sites' leaders received from other sites (delayed sync)",
            [JOB_LABEL],
            registry=r,
        )
        self.outer_steps = Gauge(
            "ringmaster_job_outer_steps",
            "Outer steps the sites took (delayed sync; every fragment's counted)",
            [JOB_LABEL],
            registry=r,
        )
        self.effective_ratio = Gauge(
            "ringmaster_job_effective_training_ratio",
            "Share of the wall time since the first completed step spent making progress",
            [JOB_LABEL],
            registry=r,
        )
        self.whole_run_ratio = Gauge(
            "ringmaster_job_whole_run_effective_ratio",
            "Share of the run's whole wall time (start-up included) spent making progress",
            [JOB_LABEL],
            registry=r,
        )
        self.time_seconds = Gauge(
            "ringmaster_job_time_seconds",
            "Where the run's wall time went: startup, productive, failures, checkpoint, other",
            [JOB_LABEL, "part"],
            registry=r,
        )
        self.productive_seconds = Gauge(
            "ringmaster_job_productive_seconds",
            "Wall time spent making progress",
            [JOB_LABEL],
            registry=r,
        )
        self.node_compute = Gauge(
            "ringmaster_node_step_compute_seconds",
            "A node's compute time per step (its slowest worker, last window)",
            [JOB_LABEL, "node"],
            registry=r,
        )
        self.node_slowdown = Gauge(
            "ringmaster_node_slowdown",
            "A node's compute time per step over its peers' median (1 = as fast)",
            [JOB_LABEL, "node"],
            registry=r,
        )
        self.link_rate = Gauge(
            "ringmaster_link_bytes_per_second",
            "Bytes a second the last link probe measured from sender to receiver",
            [JOB_LABEL, "sender", "receiver"],
            registry=r,
        )
        self._worker_bytes: dict[tuple[str, str], tuple[int, int]] = {}
        self._site_bytes: dict[tuple[str, str], int] = {}
        #: Last step and productive seconds seen per job (the counters add increases only).
        self._last_step: dict[str, int] = {}
        self._last_productive: dict[str, float] = {}
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
        self._count_increase(self.steps_total, self._last_step, job, step)
        self._count_increase(self.productive_total, self._last_productive, job, productive_s)

    def training_time(self, job: str, split: TrainingTime) -> None:
        """Where the run's wall time went (the parts of ``ringmaster_job_time_seconds``)."""
        self.whole_run_ratio.labels(job).set(split.whole_run)
        for part, seconds in time_parts(split).items():
            self.time_seconds.labels(job, part).set(seconds)

    @staticmethod
    def _count_increase(counter: Counter, last: dict[str, Any], job: str, value: float) -> None:
        """Add what ``value`` grew by since the last call; the first call only sets the base.

        A value that goes down (a restore from a checkpoint, a resubmitted run)
        becomes the new base: a counter never decreases.
        """
        before = last.get(job)
        if before is not None and value > before:
            counter.labels(job).inc(value - before)
        else:
            counter.labels(job)  # the series exists from the first call, at 0
        last[job] = value

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
        old_site = self._site_bytes.get(key, 0)
        if telemetry.site_bytes > old_site:
            self.site_bytes.labels(job).inc(telemetry.site_bytes - old_site)
            self._site_bytes[key] = telemetry.site_bytes
        if telemetry.outer_steps:
            self.outer_steps.labels(job).set(telemetry.outer_steps)
        if self._wire.get(job):
            self.compression_ratio.labels(job).set(self._dense.get(job, 0.0) / self._wire[job])

    def node_timing(self, job: str, node: str, compute_s: float, slowdown: float | None) -> None:
        """A node's last window: its compute time per step and its slowdown."""
        self.node_compute.labels(job, node).set(compute_s)
        if slowdown is not None:
            self.node_slowdown.labels(job, node).set(slowdown)

    def link_rates(self, job: str, rates: dict[str, dict[str, float]]) -> None:
        """A link probe's result: ``rates[sender][receiver]`` in bytes a second."""
        for sender, row in rates.items():
            for receiver, bps in row.items():
                self.link_rate.labels(job, sender, receiver).set(bps)

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

    def watch_etcd(self, client: EtcdClient) -> EtcdCollector:
        """Export etcd's database size, quota and alarms, read from ``client`` when scraped."""
        from orchestrator.etcd.health import read_health

        collector = EtcdCollector(lambda: read_health(client))
        self.registry.register(collector)
        return collector


class EtcdCollector(Collector):
    """etcd's space and alarms, asked of etcd at each scrape (see the module's list).

    Args:
        read: reads etcd's health now (:func:`orchestrator.etcd.health.read_health`).
    """

    #: Alarm kinds exported even while not raised (0), so an alert can watch them.
    ALWAYS = ("NOSPACE",)

    def __init__(self, read: Callable[[], EtcdHealth]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("ringmaster_etcd_up", "1 when etcd answered this scrape")
        try:
            health = self._read()
        except EtcdError as e:
            log.debug("etcd metrics not read: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        if health.db_bytes is not None:
            yield GaugeMetricFamily(
                "ringmaster_etcd_db_bytes",
                "Size of etcd's database (the largest member's), bytes",
                value=health.db_bytes,
            )
        yield GaugeMetricFamily(
            "ringmaster_etcd_quota_bytes",
            "Database size at which etcd refuses writes (--quota-backend-bytes)",
            value=health.quota_bytes,
        )
        alarm = GaugeMetricFamily(
            "ringmaster_etcd_alarm",
            "1 while etcd has an alarm of this kind raised (NOSPACE: writes refused)",
            labels=["kind"],
        )
        for kind in sorted({*self.ALWAYS, *health.alarms}):
            alarm.add_metric([kind], 1 if kind in health.alarms else 0)
        yield alarm


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
