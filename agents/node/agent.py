"""The node agent (``ringmaster agent``): one per node, supervises its workers.

It registers the node in etcd under a lease (host, address, slots, topology
labels), starts ``nproc_per_node`` workers with the job's entrypoint and the
environment of :class:`~agents.api.WorkerEnv`, and then:

* restarts a worker that exits with an error (up to ``max_restarts``),
  reporting the exit code or signal and the root cause from the worker's
  error file (torch elastic's ``@record`` format, ``TORCHELASTIC_ERROR_FILE``);
  the restarted worker rejoins as a spare and gets its state from a live peer;
* executes the controller's commands (``kill-worker`` for a hung worker, ``stop``);
* rides out etcd outages (a member down, quorum lost, this node cut off):
  workers are never killed for it; the registration is written again when
  etcd answers, under a new lease if the old one expired meanwhile (a node
  that was declared dead then comes back as a spare: its workers see a
  generation without it and wait with their stale state dropped);
* treats SIGTERM as a preemption: asks for a checkpoint, gives the workers up
  to ``preemption_grace`` to save, then stops them and leaves (revoking the
  lease, so the controller sees the node gone at once).

An agent may start before its job is submitted (a pod scheduled before
``ringmaster submit``): it says so once and waits, up to ``--wait-for-job``
(``RINGMASTER_JOB_WAIT``, default forever), writing nothing to etcd meanwhile;
SIGTERM or SIGINT while it waits just ends it (there is nothing to save).  Its
own lifecycle is logged one line per change: waiting, registered, active in
generation N or spare, leaving (and why).

Workers die with their agent (``PR_SET_PDEATHSIG``), so a SIGKILLed agent
never leaves half a node behind.  A spare agent is simply an agent whose
workers wait, warm, for a generation that includes them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from agents.api import ENV_RECOVERY, AgentError, WorkerEnv
from agents.channels.plan_feed import ENV_PLAN_FEED, PlanFeed
from agents.channels.progress import ENV_PROGRESS_SOCKET
from agents.node import log_files
from agents.node.break_reports import NodeReports
from agents.node.log_shipper import LogShipper
from agents.node.progress_relay import NodeProgress, ProgressRelay
from agents.node.restart_tier import PendingStore, RestartTier
from agents.node.warm_standby import WarmWorker
from agents.node.watches import NodeWatches
from agents.node.worker_exits import describe_failure, emit_worker_exited
from orchestrator import events, keys, records
from orchestrator.api import EtcdError, EtcdUnavailableError, JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.grpc_env import grpc_environment
from orchestrator.etcd.kv import Lease
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.jobs import read_spec, read_status, send_command
from orchestrator.liveness import LivenessServer
from orchestrator.process_lifetime import tie_to_parent
from orchestrator.records import CheckpointRecord, NodeRecord, RecordError
from orchestrator.settings import SETTINGS
from orchestrator.spec import JobSpec, RecoveryMode
from orchestrator.spec_loader import resolve_recovery

log = logging.getLogger("ringmaster.agent")

#: Node registration lease; a dead agent's node disappears within this time.
DEFAULT_NODE_TTL = SETTINGS.node_ttl
#: How long an agent waits for its job to be submitted (zero: forever).
DEFAULT_JOB_WAIT = SETTINGS.job_wait
#: How often workers are polled.
POLL = 0.05
#: How often a waiting agent looks for its job's spec.
SPEC_POLL = 0.5


class JobNotSubmittedError(AgentError):
    """The job was not submitted within the agent's wait limit (a permanent error)."""


@dataclass
class _Worker:
    local_rank: int
    proc: subprocess.Popen[bytes]
    error_file: Path
    shipper: LogShipper | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.time)
    #: restart tier: the generation the worker was launched for
    generation: int = 0
    #: restart tier: when it exited (noted by a thread that waits for it)
    exited_at: float | None = None
    #: restart tier: its exit was handled (done recorded, or failure reported)
    exit_seen: bool = False


class NodeAgent(NodeWatches, RestartTier):
    """Runs one node.  Build it, then :meth:`run` until the job ends or it is stopped."""

    def __init__(
        self,
        client: EtcdClient,
        etcd: EtcdOptions,
        job: str,
        node: str,
        labels: dict[str, str] | None = None,
        address: str = "127.0.0.1",
        workdir: str | None = None,
        ttl: timedelta = DEFAULT_NODE_TTL,
    ) -> None:
        NodeWatches.__init__(self, client, job, node, feed=None)
        self.etcd = etcd
        self.labels = dict(labels or {})
        self.labels.setdefault("host", socket.gethostname())
        self.address = address
        self.workdir = workdir or os.getcwd()
        self.ttl = ttl
        self.spec: JobSpec | None = None
        self._lease: Lease | None = None
        self._lease_lost = False
        self._reregister = threading.Event()
        self._preempted_at: float | None = None
        #: Why the agent stops, when something other than the workers decided it.
        self._stop_reason = ""
        self._errors_dir: Path | None = None
        self._liveness: LivenessServer | None = None
        #: in-process tier: relays the workers' heartbeats (agents.node.progress_relay)
        self._progress: ProgressRelay | None = None
        #: the job's resolved fault_tolerance.recovery (known once the spec is read)
        self.recovery = RecoveryMode.IN_PROCESS
        # the restart tier's state (agents.node.restart_tier)
        self._standbys: dict[int, WarmWorker] = {}
        self._launched_generation = 0
        self._launched_at: float | None = None
        self._broken_generation = 0
        self._refill_at: float | None = None
        self._pending_store: PendingStore | None = None
        #: A normal end is logged at INFO; one that lost work or failed, at WARNING.
        self._leave_level = logging.INFO
        self.exit_code = 0

    # -- lifecycle ---------------------------------------------------------------------

    def run(self, wait_for_job: timedelta = DEFAULT_JOB_WAIT) -> int:
        """Wait for the job, register, start workers, supervise.

        Args:
            wait_for_job: how long to wait for the job to be submitted (zero: forever).

        Returns:
            The process exit code: 0 when the workers finished or the agent was
            stopped (also while it waited), 1 when a worker exhausted its restarts.

        Raises:
            JobNotSubmittedError: the job was not submitted within ``wait_for_job``.
            EtcdError: etcd failed otherwise than by being unavailable for a while.
        """
        spec = self._wait_for_spec(wait_for_job)
        if spec is None or self._stop.is_set():
            log.info("[%s] leaving: %s", self.node, self._stop_reason or "stopped")
            return 0
        if spec.fault_tolerance.recovery is RecoveryMode.AUTO:
            # submitted without the entrypoint check: the script is read here
            spec, why = resolve_recovery(spec, self.workdir)
            log.info("[%s] %s", self.node, why)
        self.spec = spec
        self.recovery = spec.fault_tolerance.recovery
        restart = self.recovery is RecoveryMode.RESTART
        self._errors_dir = Path(tempfile.mkdtemp(prefix=f"rm-{self.node}-"))
        reason = "stopped"
        try:
            self._lease = self.client.lease(max(int(self.ttl.total_seconds()), 2))
            self._lease.keep_alive(on_lost=self._on_lease_lost)
            self._liveness = LivenessServer(
                self.address, self._liveness_status, log_files.requests(self.job, self.node)
            )
            if restart:
                self._refill_standbys()
            else:
                interval = spec.fault_tolerance.heartbeat_interval.total_seconds()
                self._progress = ProgressRelay(
                    self.client,
                    NodeProgress(self.job, self.node, interval),
                    NodeReports(self.job, self.node, spec.nproc_per_node),
                )
                self._feed = PlanFeed()
                for i in range(spec.nproc_per_node):
                    self._start_worker(i)
            self._register()
            log.info(
                "[%s] registered for job '%s': %d %s, liveness port %s",
                self.node,
                self.job,
                spec.nproc_per_node,
                "warm standby(s) (restart tier)" if restart else "worker(s)",
                self._liveness.address,
            )
            for target, name in (
                (self._keep_registered, "registration"),
                (self._follow_commands, "commands"),
            ):
                threading.Thread(target=target, name=name, daemon=True).start()
            self.watch_plan()
            reason = self._supervise_restart() if restart else self._supervise()
        except BaseException as e:
            reason = f"{type(e).__name__}: {e}"
            self._leave_level = logging.WARNING
            raise
        finally:
            self._stop.set()
            level = logging.WARNING if self.exit_code else self._leave_level
            log.log(level, "[%s] leaving: %s", self.node, self._stop_reason or reason)
            if self._liveness is not None:
                self._liveness.close()
            self._stop_workers()
            if self._progress is not None:
                self._progress.close()
            if self._feed is not None:
                self._feed.close()
            self._discard_standbys()
            if self._lease is not None:
                self._lease.revoke()
            shutil.rmtree(self._errors_dir, ignore_errors=True)
        return self.exit_code

    def request_stop(self, reason: str = "interrupted") -> None:
        """Stop (SIGINT handler, ``stop`` command): workers are stopped, no save is asked."""
        self._stop_reason = self._stop_reason or reason
        self._stop.set()

    def preempt(self) -> None:
        """SIGTERM handler: save first (within the grace period), then leave.

        While the agent still waits for its job there is nothing to save: it
        just stops, writing nothing for a job that may never exist.
        """
        if self.spec is None:
            self.request_stop(f"SIGTERM while waiting for job '{self.job}' to be submitted")
            return
        if self._preempted_at is not None:
            return
        if self.recovery is RecoveryMode.RESTART:
            # the script saves its own checkpoints: there is no save to ask for
            self.request_stop("preempted (SIGTERM); a spare takes this node's slot")
            return
        self._preempted_at = time.monotonic()
        grace = self.spec.fault_tolerance.preemption_grace if self.spec else timedelta(0)
        log.warning("[%s] preempted: saving within %.0fs", self.node, grace.total_seconds())
        with contextlib.suppress(Exception):
            events.emit(
                self.client,
                self.job,
                "Preempted",
                f"{self.node} got SIGTERM; checkpoint requested",
                source=self.node,
            )
            send_command(self.client, self.job, "checkpoint", reason=f"preemption of {self.node}")

    def _wait_for_spec(self, limit: timedelta) -> JobSpec | None:
        """The job's spec once it is submitted; None when stopped first.

        Only reads etcd: an agent whose job never comes leaves nothing behind.
        An etcd outage while waiting is waited out (within ``limit``).

        Raises:
            JobNotSubmittedError: ``limit`` (non-zero) passed without the job.
        """
        seconds = limit.total_seconds()
        started = time.monotonic()
        key = keys.job_spec(self.job)
        announced = False
        while not self._stop.is_set():
            left = seconds - (time.monotonic() - started) if seconds > 0 else None
            try:
                found = retry_unavailable(
                    lambda: self.client.get(key),
                    f"[{self.node}] looking for job '{self.job}'",
                    stop=self._stop,
                    max_wait=timedelta(seconds=max(left, 0)) if left is not None else None,
                )
            except EtcdUnavailableError:
                if self._stop.is_set():
                    return None
                raise
            if found is not None:
                if announced:
                    log.info(
                        "[%s] job '%s' submitted after %.0fs of waiting",
                        self.node,
                        self.job,
                        time.monotonic() - started,
                    )
                return read_spec(self.client, self.job)[0]
            if not announced:
                announced = True
                log.info(
                    "[%s] waiting for job '%s' to be submitted (`ringmaster submit job.yaml`); %s",
                    self.node,
                    self.job,
                    f"giving up after {seconds:g}s" if seconds > 0 else "no time limit",
                )
            left = seconds - (time.monotonic() - started) if seconds > 0 else None
            if left is not None and left <= 0:
                raise JobNotSubmittedError(
                    f"job '{self.job}' was not submitted within {seconds:g}s: submit it "
                    f"(`ringmaster submit job.yaml`) and start the agent again, or let it wait "
                    f"longer (--wait-for-job SECONDS, 0 = forever; env RINGMASTER_JOB_WAIT)"
                )
            self._stop.wait(SPEC_POLL if left is None else min(SPEC_POLL, left))
        return None

    def _on_lease_lost(self, lease: Lease) -> None:
        log.warning("[%s] registration lease %x expired; registering again", self.node, lease.id)
        self._lease_lost = True
        self._reregister.set()

    def _keep_registered(self) -> None:
        """Write the registration again when asked (lease lost, a write failed)."""
        while not self._stop.is_set():
            if not self._reregister.wait(0.5):
                continue
            self._reregister.clear()
            try:
                retry_unavailable(self._renew, f"[{self.node}] registering", stop=self._stop)
            except EtcdError as e:
                if not self._stop.is_set():
                    log.error("[%s] could not register again: %s", self.node, e)
                    self._reregister.set()

    def _renew(self) -> None:
        if self._lease_lost:
            lease = self.client.lease(max(int(self.ttl.total_seconds()), 2))
            lease.keep_alive(on_lost=self._on_lease_lost)
            self._lease, self._lease_lost = lease, False
        self._register()

    def _safe_register(self) -> None:
        try:
            self._register()
        except EtcdError as e:
            log.warning("[%s] registration not updated (will retry): %s", self.node, e)
            self._reregister.set()

    def _register(self) -> None:
        assert self._lease is not None and self.spec is not None
        registration = NodeRecord(
            host=socket.gethostname(),
            address=self.address,
            slots=self.spec.nproc_per_node,
            pid=os.getpid(),
            worker_pids=[w.proc.pid for w in self.workers.values()]
            + [s.pid for s in self._standbys.values()],
            started=time.time(),
            labels=self.labels,
            liveness=self._liveness.address if self._liveness else None,
            recovery=self.recovery.value,
            generation=self._launched_generation,
            launched_at=self._launched_at,
        )
        records.write(self.client, keys.job_node(self.job, self.node), registration, self._lease)

    def _liveness_status(self) -> dict[str, Any]:
        """What the liveness port answers: which local workers are running, and (the
        in-process tier) the latest beat of each as the agent received it."""
        status: dict[str, Any] = {
            "node": self.node,
            "workers": {str(r): w.proc.poll() is None for r, w in list(self.workers.items())},
        }
        if self._progress is not None:
            status["beats"] = self._progress.progress.beats()
        return status

    # -- workers -----------------------------------------------------------------------

    def _worker_env(self, local_rank: int) -> dict[str, str]:
        """The environment of worker ``local_rank`` (of either tier), before its error file."""
        assert self.spec is not None
        env = {**grpc_environment(), **os.environ}
        env.update(self.spec.entrypoint.env)
        env.update(
            WorkerEnv(
                job=self.job,
                node=self.node,
                local_rank=local_rank,
                local_world_size=self.spec.nproc_per_node,
                etcd_endpoints=",".join(self.etcd.endpoints),
                address=self.address,
                etcd_ca=self.etcd.ca_cert,
                etcd_cert=self.etcd.cert,
                etcd_key=self.etcd.key,
                etcd_user=self.etcd.user,
                etcd_password=self.etcd.password,
            ).to_environ()
        )
        env[ENV_RECOVERY] = self.recovery.value
        if self._progress is not None:
            env[ENV_PROGRESS_SOCKET] = self._progress.address
        else:  # not one inherited from a parent agent
            env.pop(ENV_PROGRESS_SOCKET, None)
        if self._feed is not None:
            env[ENV_PLAN_FEED] = self._feed.address
        else:
            env.pop(ENV_PLAN_FEED, None)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _start_worker(self, local_rank: int, restarts: int = 0) -> None:
        assert self.spec is not None and self._errors_dir is not None
        env = self._worker_env(local_rank)
        error_file = self._errors_dir / f"worker-{local_rank}-{restarts}.json"
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
        proc = subprocess.Popen(
            [sys.executable, *self.spec.entrypoint.command()],
            cwd=self.workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=tie_to_parent(),
        )
        assert proc.stdout is not None
        shipper = LogShipper(self.client, self.job, self.node, local_rank, sys.stdout.buffer)
        shipper.start(proc.stdout)
        self.workers[local_rank] = _Worker(local_rank, proc, error_file, shipper, restarts)
        if self._lease is not None:
            self._safe_register()

    def _supervise(self) -> str:
        """Watch the workers until the agent should leave; returns why it leaves."""
        assert self.spec is not None
        max_restarts = self.spec.fault_tolerance.max_restarts
        grace = self.spec.fault_tolerance.preemption_grace.total_seconds()
        while not self._stop.is_set():
            if self._preempted_at is not None and time.monotonic() - self._preempted_at > grace:
                self._leave_level = logging.WARNING
                return f"preempted; no checkpoint committed within the {grace:g}s grace"
            finished = 0
            for w in list(self.workers.values()):
                code = w.proc.poll()
                if code is None:
                    continue
                if code == 0:
                    finished += 1
                    continue
                self._on_worker_failure(w, code, max_restarts)
            if finished == len(self.workers):
                phase = self._job_phase()
                return "workers finished" + (f" (job {phase.value})" if phase else "")
            if self._preempted_at is not None and self._saved_since_preemption():
                return "preempted; checkpoint committed"
            self._stop.wait(POLL)
        return "stopped"

    def _saved_since_preemption(self) -> bool:
        key = keys.job_checkpoint(self.job)
        try:
            record = records.read(self.client, key, CheckpointRecord)
        except EtcdError:
            return False
        except RecordError as e:  # not proof of a save: wait out the grace period
            log.warning("[%s] checkpoint record unreadable: %s", self.node, e)
            return False
        since = self._preempted_wall
        return record is not None and since is not None and record.at >= since

    @property
    def _preempted_wall(self) -> float | None:
        if self._preempted_at is None:
            return None
        return time.time() - (time.monotonic() - self._preempted_at)

    def _on_worker_failure(self, w: _Worker, code: int, max_restarts: int) -> None:
        what = describe_failure(code, w.error_file, w.shipper)
        name = keys.worker_id(self.node, w.local_rank)
        log.warning("[%s] worker %s failed (%s)", self.node, name, what)
        phase = self._job_phase()
        emit_worker_exited(self.client, self.job, self.node, name, code, what)
        if phase is not None and phase.terminal:
            self.workers.pop(w.local_rank)
            return
        if w.restarts >= max_restarts:
            log.error("[%s] %s exhausted %d restarts", self.node, name, max_restarts)
            self.exit_code = 1
            self.request_stop(f"{name} exhausted {max_restarts} restarts")
            return
        self._start_worker(w.local_rank, w.restarts + 1)

    def _job_phase(self) -> JobPhase | None:
        with contextlib.suppress(Exception):
            status = read_status(self.client, self.job)
            return status.phase if status else None
        return None

    def _stop_workers(self, timeout: float = 5.0) -> None:
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.terminate()
        deadline = time.monotonic() + timeout
        for w in self.workers.values():
            try:
                w.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for w in self.workers.values():
            if w.shipper is not None:
                w.shipper.join(timeout=2.0)  # the last lines reach etcd
