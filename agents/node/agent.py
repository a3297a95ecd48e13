"""The node agent (``ringmaster agent``): one per node, supervises its workers.

Runs in the agent's own process.  It registers the node in etcd under a lease
(host, address, slots, topology labels), hands its workers to the job's tier
(each worker with the job's entrypoint, the environment of
:class:`~agents.api.WorkerEnv`, in a process group of its own), and then:

* lets the tier supervise them: the in-process tier
  (:mod:`agents.node.in_process_tier`) restarts a worker that exits with an
  error, the restart tier (:mod:`agents.node.restart_tier`) launches each
  generation's workers from warm standbys;
* serves its port (:mod:`agents.node.agent_port`): the liveness status and
  watch to anyone, its workers' output and the link probes only to requests
  that carry the job's credential from etcd;
* executes the controller's commands (``kill-worker`` for a hung worker, ``stop``),
  which its watches (:mod:`agents.node.watches`) read;
* rides out etcd outages (a member down, quorum lost, this node cut off):
  workers are never killed for it; the registration is written again when
  etcd answers, under a new lease if the old one expired meanwhile (a node
  that was declared dead then comes back as a spare: its workers see a
  generation without it and wait with their stale state dropped);
* treats SIGTERM as a preemption: asks for a checkpoint, gives the workers up
  to ``preemption_grace`` to save, then stops them and leaves (revoking the
  lease, so the controller sees the node gone at once).

An agent may start before its job is submitted (a pod scheduled before
``ringmaster submit``), or after the job's last run ended (between ``stop``
and ``resume``): it says so once and waits for a run it may join
(:mod:`agents.node.job_wait`), up to ``--wait-for-job``
(``RINGMASTER_JOB_WAIT``, default forever), writing nothing to etcd meanwhile;
SIGTERM or SIGINT while it waits just ends it (there is nothing to save).  It
serves that one run: when the run is over (its phase final, or a newer run
started) the agent leaves.  Its
own lifecycle is logged one line per change: waiting, registered, active in
generation N or spare, leaving (and why).

Workers die with their agent (``PR_SET_PDEATHSIG``, see
:mod:`orchestrator.process_lifetime`), so a SIGKILLed agent never leaves half a
node behind.  What a worker started itself goes with the worker's process
group when the agent stops the worker or sees it exit; only an agent
SIGKILLed on a machine that lives on leaves those behind (a machine's death
takes them all).  A spare agent is simply an agent whose workers wait, warm,
for a generation that includes them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from agents.api import ENV_RECOVERY, WorkerEnv
from agents.channels.plan_feed import ENV_PLAN_FEED, PlanFeed
from agents.channels.progress import ENV_PROGRESS_SOCKET
from agents.node.agent_port import open_port
from agents.node.api import JobNotSubmittedError, NodeRefusedError, Tier, TierSetup
from agents.node.break_reports import NodeReports
from agents.node.capacity import capacity_problem, usable_cpus, visible_gpus
from agents.node.in_process_tier import InProcessTier
from agents.node.job_wait import wait_for_run
from agents.node.progress_relay import NodeProgress, ProgressRelay
from agents.node.restart_tier import RestartTier
from agents.node.watches import NodeWatches
from orchestrator.api import EtcdError
from orchestrator.checkpoint_root.reach import script_storage
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.grpc_env import grpc_environment
from orchestrator.etcd.kv import Lease
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.ports.liveness import LivenessServer
from orchestrator.settings import SETTINGS
from orchestrator.spec.entrypoint import resolve_recovery
from orchestrator.spec.job import JobSpec, RecoveryMode, restart_tier_refusal
from orchestrator.state import events, keys, records
from orchestrator.state.jobs import send_command
from orchestrator.state.records import NodeRecord

__all__ = [
    "DEFAULT_JOB_WAIT",
    "DEFAULT_NODE_TTL",
    "JobNotSubmittedError",
    "NodeAgent",
    "NodeRefusedError",
]

log = logging.getLogger("ringmaster.agent")

#: Node registration lease; a dead agent's node disappears within this time.
DEFAULT_NODE_TTL = SETTINGS.node_ttl
#: How long an agent waits for its job to be submitted, or for its next run (zero: forever).
DEFAULT_JOB_WAIT = SETTINGS.job_wait


class NodeAgent:
    """Runs one node.  Build it, then :meth:`run` until the job ends or it is stopped.

    Its parts: the watches of etcd (:class:`~agents.node.watches.NodeWatches`), the
    tier that runs the workers (:class:`~agents.node.api.Tier`), and, in the
    in-process tier, the relay of the workers' progress and the plan feed.
    """

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
        self.client = client
        self.etcd = etcd
        self.job = job
        self.node = keys.segment(node, "node name")
        self.labels = dict(labels or {})
        self.labels.setdefault("host", socket.gethostname())
        self.address = address
        self.workdir = workdir or os.getcwd()
        self.ttl = ttl
        self.spec: JobSpec | None = None
        #: the run of the job it joined (known once it has one to join)
        self.job_run = 0
        #: the job's resolved fault_tolerance.recovery (known once the spec is read)
        self.recovery = RecoveryMode.IN_PROCESS
        self.exit_code = 0
        self._stop = threading.Event()
        self._lease: Lease | None = None
        self._lease_lost = False
        self._reregister = threading.Event()
        self._preempted_at: float | None = None
        #: the tier started every worker (a SIGTERM before then just stops it)
        self._started = False
        #: Why the agent stops, when something other than the workers decided it.
        self._stop_reason = ""
        self._liveness: LivenessServer | None = None
        self._tier: Tier | None = None
        #: restart tier: where the script's checkpoint is as this node sees it
        self._script_storage: str | None = None
        #: in-process tier: relays the workers' heartbeats (agents.node.progress_relay)
        self._progress: ProgressRelay | None = None
        #: in-process tier: passes the plan and control record on (agents.channels.plan_feed)
        self._feed: PlanFeed | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def run(self, wait_for_job: timedelta = DEFAULT_JOB_WAIT) -> int:
        """Wait for the job, register, start workers, supervise.

        Args:
            wait_for_job: how long to wait for a run of the job to join (zero: forever).

        Returns:
            The process exit code: 0 when the workers finished or the agent was
            stopped (also while it waited), 1 when a worker exhausted its restarts.

        Raises:
            JobNotSubmittedError: no run of the job to join came within ``wait_for_job``.
            EtcdError: etcd failed otherwise than by being unavailable for a while.
        """
        joined = wait_for_run(self.client, self.job, self.node, self._stop, wait_for_job)
        if joined is None or self._stop.is_set():
            log.info("[%s] leaving: %s", self.node, self._stop_reason or "stopped")
            return 0
        spec, self.job_run = joined.spec, joined.run
        if spec.fault_tolerance.recovery is RecoveryMode.AUTO:
            # submitted without the entrypoint check: the script is read here
            spec, why = resolve_recovery(spec, self.workdir, strict=False)
            log.info("[%s] %s", self.node, why)
        plain = spec.fault_tolerance.recovery is RecoveryMode.RESTART
        for path, reason in spec.runtime_settings() if plain else ():  # not refused here
            log.warning("[%s] %s has no effect: %s", self.node, path, restart_tier_refusal(reason))
        self.spec = spec
        self.recovery = spec.fault_tolerance.recovery
        restart = self.recovery is RecoveryMode.RESTART
        self._refuse_beyond_capacity(spec, in_process=not restart)
        if restart:  # the controller refuses to start nodes that do not share it
            self._script_storage = script_storage(spec, self.workdir)
        errors_dir = Path(tempfile.mkdtemp(prefix=f"rm-{self.node}-"))
        reason, level = "stopped", logging.INFO
        try:
            self._lease = self.client.lease(max(int(self.ttl.total_seconds()), 2))
            self._lease.keep_alive(on_lost=self._on_lease_lost)
            # the status and watch for anyone; the rest for the job's credential holders
            self._liveness = open_port(
                self.client, self.job, self.node, self.address, self._liveness_status
            )
            if not restart:
                interval = spec.fault_tolerance.heartbeat_interval.total_seconds()
                self._progress = ProgressRelay(
                    self.client,
                    NodeProgress(self.job, self.node, interval),
                    NodeReports(self.job, self.node, spec.nproc_per_node),
                )
                self._feed = PlanFeed()
            watches = NodeWatches(
                self.client, self.job, self.node, self._feed, stop=self._stop, commands=self
            )
            setup = TierSetup(
                client=self.client,
                job=self.job,
                node=self.node,
                run=joined.run,
                spec=spec,
                workdir=self.workdir,
                errors_dir=errors_dir,
                stop=self._stop,
                worker_env=self._worker_env,
                register=self._safe_register,
            )
            if restart:
                self._tier = RestartTier(setup, self.address, watches)
            else:
                self._tier = tier = InProcessTier(setup)
                if self._preempted_at is not None:  # SIGTERM came while it was being built
                    tier.preempt(self._preempted_at)
            self._tier.start()
            self._started = True
            if self._stop.is_set():  # stopped while it started its workers
                return self.exit_code
            self._register()
            log.info(
                "[%s] registered for job '%s': %d %s, liveness port %s",
                self.node,
                self.job,
                spec.nproc_per_node,
                "warm standby(s) (restart tier)" if restart else "worker(s)",
                self._liveness.address,
            )
            threading.Thread(target=self._keep_registered, name="registration", daemon=True).start()
            watches.watch_commands()
            watches.watch_plan()
            outcome = self._tier.supervise()
            reason, self.exit_code = outcome.reason, outcome.exit_code
            if outcome.lost_work or outcome.exit_code:
                level = logging.WARNING
        except BaseException as e:
            reason, level = f"{type(e).__name__}: {e}", logging.WARNING
            raise
        finally:
            self._stop.set()
            log.log(level, "[%s] leaving: %s", self.node, self._stop_reason or reason)
            # workers saving on their own (a preempted restart-tier node's) end before the
            # node counts as gone: no new generation reads what they are writing
            first = isinstance(self._tier, RestartTier) and self._tier.stops_first
            if self._tier is not None and first:
                self._tier.close()
            if self._liveness is not None:
                self._liveness.close()
            if self._tier is not None and not first:
                self._tier.close()
            if self._progress is not None:
                self._progress.close()
            if self._feed is not None:
                self._feed.close()
            if self._lease is not None:
                self._lease.revoke()
            shutil.rmtree(errors_dir, ignore_errors=True)
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
        if not self._started:  # no worker has trained here yet: nothing to save
            self.request_stop("SIGTERM while starting its workers")
            return
        if self.recovery is RecoveryMode.RESTART:
            # the script saves its own checkpoints: there is no save to ask for, but, as
            # under torchrun, its workers get SIGTERM and time to save on their own
            seconds = self.spec.fault_tolerance.preemption_grace.total_seconds()
            if isinstance(self._tier, RestartTier):
                self._tier.preempted(seconds)
            self.request_stop(
                f"preempted (SIGTERM); the workers get SIGTERM and {seconds:g}s to exit "
                "(fault_tolerance.preemption_grace); a spare takes this node's slot"
            )
            return
        self._preempted_at = time.monotonic()
        if isinstance(self._tier, InProcessTier):
            self._tier.preempt(self._preempted_at)
        grace = self.spec.fault_tolerance.preemption_grace
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

    def _refuse_beyond_capacity(self, spec: JobSpec, in_process: bool) -> None:
        """Refuse, before any worker starts, more workers than this node can run.

        Raises:
            NodeRefusedError: one line naming the limit and what to change; the job's
                events get it too (``NodeRefused``), so whoever watches the job sees why
                the node never comes.
        """
        problem = capacity_problem(spec, self.node, usable_cpus(), visible_gpus(), in_process)
        if problem is None:
            return
        with contextlib.suppress(EtcdError):
            events.emit(self.client, self.job, "NodeRefused", problem, source=self.node)
        raise NodeRefusedError(problem)

    def kill_worker(self, local_rank: int, pid: int | None, reason: str) -> None:
        """The controller's ``kill-worker`` (a hung worker): SIGKILL its process group.

        Nothing is killed when ``pid`` names a worker that was replaced since.
        """
        w = self._tier.workers.get(local_rank) if self._tier is not None else None
        if w is not None and pid is not None and w.pid != pid:
            log.warning(
                "[%s] not killing worker %d: pid %s named by the command has already "
                "been replaced by %d",
                self.node,
                local_rank,
                pid,
                w.pid,
            )
        elif w is not None and w.running():
            log.warning("[%s] killing worker %d (%s)", self.node, local_rank, reason)
            w.kill()

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
        tier = self._tier
        registration = NodeRecord(
            host=socket.gethostname(),
            address=self.address,
            slots=self.spec.nproc_per_node,
            pid=os.getpid(),
            worker_pids=tier.pids() if tier is not None else [],
            started=time.time(),
            labels=self.labels,
            liveness=self._liveness.address if self._liveness else None,
            recovery=self.recovery.value,
            generation=tier.generation if tier is not None else 0,
            launched_at=tier.launched_at if tier is not None else None,
            progress_at=tier.progress_at if tier is not None else None,
            script_storage=self._script_storage,
        )
        records.write(self.client, keys.job_node(self.job, self.node), registration, self._lease)

    def _liveness_status(self) -> dict[str, Any]:
        """What the liveness port answers: which local workers are running, and (the
        in-process tier) the latest beat of each as the agent received it."""
        workers = self._tier.workers if self._tier is not None else {}
        status: dict[str, Any] = {
            "node": self.node,
            "workers": {str(r): w.running() for r, w in list(workers.items())},
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
