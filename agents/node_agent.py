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

Workers die with their agent (``PR_SET_PDEATHSIG``), so a SIGKILLed agent
never leaves half a node behind.  A spare agent is simply an agent whose
workers wait, warm, for a generation that includes them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
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

from agents.api import WorkerEnv
from agents.log_shipper import LogShipper
from orchestrator import events, keys, records
from orchestrator.api import EtcdError, JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.grpc_env import grpc_environment
from orchestrator.etcd.kv import Lease
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.jobs import read_spec, read_status, send_command
from orchestrator.liveness import LivenessServer
from orchestrator.process_lifetime import tie_to_parent
from orchestrator.records import AgentCommand, CheckpointRecord, NodeRecord, RecordError
from orchestrator.settings import SETTINGS
from orchestrator.spec import JobSpec

log = logging.getLogger("ringmaster.agent")

#: Node registration lease; a dead agent's node disappears within this time.
DEFAULT_NODE_TTL = SETTINGS.node_ttl
#: How often workers are polled.
POLL = 0.05


@dataclass
class _Worker:
    local_rank: int
    proc: subprocess.Popen[bytes]
    error_file: Path
    shipper: LogShipper | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.time)


def parse_labels(text: str | None) -> dict[str, str]:
    """``zone=a,rack=r1`` → ``{"zone": "a", "rack": "r1"}``.

    Raises:
        ValueError: an item is not ``key=value``, or a name or value is not safe
            (see :func:`orchestrator.keys.labels`).
    """
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label {item!r} is not key=value (e.g. zone=a,rack=r1)")
        out[key.strip()] = value.strip()
    return keys.labels(out)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def read_error_file(path: Path) -> str | None:
    """The root-cause message from a torch elastic error file, if the worker wrote one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message", data)
    if isinstance(message, dict):
        message = message.get("message", json.dumps(message))
    return str(message).splitlines()[0][:300] if message else None


class NodeAgent:
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
        self.workers: dict[int, _Worker] = {}
        self._lease: Lease | None = None
        self._lease_lost = False
        self._reregister = threading.Event()
        self._stop = threading.Event()
        self._preempted_at: float | None = None
        self._errors_dir = Path(tempfile.mkdtemp(prefix=f"rm-{self.node}-"))
        self._liveness: LivenessServer | None = None
        self.exit_code = 0

    # -- lifecycle ---------------------------------------------------------------------

    def run(self, spec_timeout: timedelta = timedelta(seconds=60)) -> int:
        """Register, start workers, supervise.  Returns the process exit code."""
        self.spec = self._wait_for_spec(spec_timeout)
        self._lease = self.client.lease(max(int(self.ttl.total_seconds()), 2))
        self._lease.keep_alive(on_lost=self._on_lease_lost)
        self._liveness = LivenessServer(self.address, self._liveness_status)
        for i in range(self.spec.nproc_per_node):
            self._start_worker(i)
        self._register()
        threading.Thread(target=self._keep_registered, name="registration", daemon=True).start()
        threading.Thread(target=self._follow_commands, name="commands", daemon=True).start()
        try:
            self._supervise()
        finally:
            self._stop.set()
            if self._liveness is not None:
                self._liveness.close()
            self._stop_workers()
            if self._lease is not None:
                self._lease.revoke()
        return self.exit_code

    def request_stop(self) -> None:
        self._stop.set()

    def preempt(self) -> None:
        """SIGTERM handler: save first (within the grace period), then leave."""
        if self._preempted_at is not None:
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

    def _wait_for_spec(self, timeout: timedelta) -> JobSpec:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            if self.client.get(keys.job_spec(self.job)) is not None:
                return read_spec(self.client, self.job)[0]
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job '{self.job}' was not submitted within {timeout.total_seconds():g}s"
                )
            time.sleep(0.2)

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
            worker_pids=[w.proc.pid for w in self.workers.values()],
            started=time.time(),
            labels=self.labels,
            liveness=self._liveness.address if self._liveness else None,
        )
        records.write(self.client, keys.job_node(self.job, self.node), registration, self._lease)

    def _liveness_status(self) -> dict[str, Any]:
        """What the liveness port answers: which local workers are running."""
        return {
            "node": self.node,
            "workers": {str(r): w.proc.poll() is None for r, w in list(self.workers.items())},
        }

    # -- workers -----------------------------------------------------------------------

    def _start_worker(self, local_rank: int, restarts: int = 0) -> None:
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
        error_file = self._errors_dir / f"worker-{local_rank}-{restarts}.json"
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
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

    def _supervise(self) -> None:
        assert self.spec is not None
        max_restarts = self.spec.fault_tolerance.max_restarts
        grace = self.spec.fault_tolerance.preemption_grace.total_seconds()
        while not self._stop.is_set():
            if self._preempted_at is not None and time.monotonic() - self._preempted_at > grace:
                log.warning("[%s] preemption grace over; leaving", self.node)
                return
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
                return
            if self._preempted_at is not None and self._saved_since_preemption():
                log.warning("[%s] preemption checkpoint committed; leaving", self.node)
                return
            self._stop.wait(POLL)

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
        cause = read_error_file(w.error_file) or (w.shipper.last_error() if w.shipper else None)
        what = describe_exit(code) + (f": {cause}" if cause else "")
        name = keys.worker_id(self.node, w.local_rank)
        log.warning("[%s] worker %s failed (%s)", self.node, name, what)
        phase = self._job_phase()
        with contextlib.suppress(Exception):
            events.emit(
                self.client,
                self.job,
                "WorkerExited",
                f"{name} {what}",
                source=self.node,
                worker=name,
                exit_code=code,
            )
        if phase is not None and phase.terminal:
            self.workers.pop(w.local_rank)
            return
        if w.restarts >= max_restarts:
            log.error("[%s] %s exhausted %d restarts", self.node, name, max_restarts)
            self.exit_code = 1
            self._stop.set()
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

    def _follow_commands(self) -> None:
        """Execute the controller's commands; the watch is renewed after etcd outages."""
        prefix = keys.agent_commands(self.job, self.node)
        while not self._stop.is_set():
            watch: Any = None
            try:
                watch = self.client.watch(prefix, prefix=True)
                # commands written while no watch ran
                for kv in self.client.get_prefix(prefix):
                    self._take(kv.key, kv.value)
                for ev in watch:
                    if self._stop.is_set():
                        break
                    if ev.value is not None:
                        self._take(ev.key, ev.value)
            except Exception as e:  # etcd went away, or the watch was cancelled
                log.debug("command watch ended: %s", e)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        watch.cancel()
            self._stop.wait(0.5)

    def _take(self, key: str, value: bytes) -> None:
        with contextlib.suppress(Exception):
            if not self.client.delete(key):
                return  # already executed
        try:
            cmd = records.decode(AgentCommand, value, key)
        except RecordError as e:
            log.warning("[%s] ignoring a command that cannot be read: %s", self.node, e)
            return
        self._execute(cmd)

    def _execute(self, cmd: AgentCommand) -> None:
        name = cmd.command
        if name == "kill-worker":
            w = self.workers.get(cmd.local_rank)
            pid = cmd.pid
            if w is not None and pid is not None and w.proc.pid != pid:
                log.warning(
                    "[%s] not killing worker %d: pid %s named by the command has already "
                    "been replaced by %d",
                    self.node,
                    w.local_rank,
                    pid,
                    w.proc.pid,
                )
            elif w is not None and w.proc.poll() is None:
                log.warning(
                    "[%s] killing worker %d (%s)", self.node, w.local_rank, cmd.reason
                )
                w.proc.kill()
        elif name == "stop":
            self._stop.set()
        else:
            log.warning("[%s] unknown command %r", self.node, name)
