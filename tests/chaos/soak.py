"""The chaos soak: a seeded schedule of real faults injected into one local run.

Fault kinds (each used at least once per schedule):

* ``node-kill``       SIGKILL a whole active node (agent and workers);
* ``worker-kill``     SIGKILL one active worker (its agent restarts it);
* ``controller-kill`` SIGKILL the leading controller (a standby leads);
* ``worker-hang``     SIGSTOP one active worker (hang detection kills it);
* ``preemption``      SIGTERM an active node (save within the grace, then leave);
* ``upload-kill``     SIGKILL an active node while a checkpoint is uploading;
* ``etcd-restart``    SIGKILL one member of the 3-member etcd cluster, restart it 2 s later.

A fault is injected once the job has reached its step, trains again after
the previous fault (and has made progress since), with a leader and a warm
spare available; whatever a fault used up (a
node, a controller) is replaced by a fresh process, as a cluster would.  The
seed and the schedule are printed, so a failing run can be replayed with
``RINGMASTER_SOAK_SEED``.

The job has a fixed length, and on a loaded machine faults go in later than
planned (each waits for the last one's repair while the job trains on).  So the
workers hold before a step near the end (``--hold-at``) until every fault has
gone in (the injector then writes the go-file); a held job makes no progress, so
there the progress rule is dropped.  ``upload-kill`` needs an upload in flight,
which a held job never has: it is always the first fault.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.api import JobPhase
from orchestrator.controller.world import read_progress
from orchestrator.local_run import LocalRun
from orchestrator.state import jobs, keys
from tests.faults.etcd_cluster import EtcdCluster

KINDS = (
    "node-kill",
    "worker-kill",
    "controller-kill",
    "worker-hang",
    "preemption",
    "upload-kill",
    "etcd-restart",
)
#: Seconds an etcd member stays down before it is restarted.
ETCD_DOWN_S = 2.0
#: Steps of progress between two faults, at least.
MIN_GAP = 15
#: Kinds after which the node is gone and a fresh spare is started.
CONSUMES_NODE = {"node-kill", "preemption", "upload-kill"}


@dataclass
class Fault:
    kind: str
    at_step: int
    target: str = ""
    injected_step: int = -1
    injected_at: float = 0.0

    def __str__(self) -> str:
        where = f" {self.target} at step {self.injected_step}" if self.target else ""
        return f"{self.kind}@{self.at_step}{where}"


def plan_faults(seed: int, count: int, first_step: int, gap: int) -> list[Fault]:
    """``count`` faults, every kind at least once, in a seeded order."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    while len(kinds) < count:
        kinds.append(rng.choice(KINDS))
    rng.shuffle(kinds)
    kinds.remove("upload-kill")  # first: it needs uploads, which a held job has none of
    kinds.insert(0, "upload-kill")
    return [Fault(kind, first_step + i * gap) for i, kind in enumerate(kinds)]


@dataclass
class Injector:
    """Injects ``faults`` into ``run`` in order; :meth:`poll` from the test's loop."""

    run: LocalRun
    faults: list[Fault]
    checkpoint_dir: Path
    rng: random.Random
    cluster: EtcdCluster
    #: the step the workers hold before until ``go_file`` exists
    hold_at: int
    go_file: Path
    done: list[Fault] = field(default_factory=list)
    _nodes_started: int = 0
    _controllers_started: int = 0

    def __post_init__(self) -> None:
        self._nodes_started = self.run.spec.nodes.max + self.run.spec.nodes.spares
        self._controllers_started = self.run.controllers
        self._uploads_seen: set[str] = set()
        self._etcd_down: tuple[int, float] | None = None  # member, when to restart it

    @property
    def pending(self) -> list[Fault]:
        return self.faults[len(self.done) :]

    def poll(self) -> None:
        if self._etcd_down is not None and time.monotonic() >= self._etcd_down[1]:
            self.cluster.restart(self._etcd_down[0])
            self.run.print(f"[soak] etcd member {self._etcd_down[0]} restarted")
            self._etcd_down = None
        if not self.pending or self._etcd_down is not None:
            return
        fault = self.pending[0]
        client = self.run._client
        assert client is not None
        status = jobs.read_status(client, self.run.spec.name)
        if status is None or status.phase is not JobPhase.RUNNING or status.step < fault.at_step:
            return
        last = self.done[-1] if self.done else None
        held = status.step >= self.hold_at - 1
        if last is not None and (
            status.updated_at < last.injected_at + 0.5  # no news since the last fault
            or (status.step < last.injected_step + MIN_GAP and not held)
        ):
            return
        if not status.spare_nodes or len(status.active_nodes) < self.run.spec.nodes.max:
            return  # wait until the last fault is fully repaired
        if client.get(keys.controller_leader(self.run.spec.name)) is None:
            return  # a standby has not taken over yet
        active = list(status.active_nodes)
        if fault.kind == "upload-kill" and not self._upload_in_flight():
            return
        fault.injected_step, fault.injected_at = status.step, time.time()
        self._inject(fault, active)
        self.done.append(fault)
        self.run.print(f"[soak] injected {fault}")
        if not self.pending:
            self.release()

    def release(self) -> None:
        """Let held workers go on (every fault is in, or the test gives up)."""
        self.go_file.touch()

    def _upload_in_flight(self) -> bool:
        """A checkpoint directory without a manifest appeared since the last look."""
        if not self.checkpoint_dir.exists():
            return False
        for d in self.checkpoint_dir.iterdir():
            uploading = d.is_dir() and not (d / "manifest.json").exists()
            if uploading and d.name not in self._uploads_seen:
                self._uploads_seen.add(d.name)
                return True
        return False

    def _inject(self, fault: Fault, active: list[str]) -> None:
        node = self.rng.choice(active)
        if fault.kind in ("node-kill", "upload-kill"):
            fault.target = node
            self.run.kill_node(node)
        elif fault.kind == "preemption":
            fault.target = node
            self.run.signal_node(node, signal.SIGTERM)
        elif fault.kind in ("worker-kill", "worker-hang"):
            pid = self._worker_pid(node)
            fault.target = f"{node} worker pid {pid}"
            os.kill(pid, signal.SIGKILL if fault.kind == "worker-kill" else signal.SIGSTOP)
        elif fault.kind == "etcd-restart":
            member = self.rng.randrange(len(self.cluster.members))
            fault.target = f"etcd member {member}"
            self.cluster.kill(member)
            self._etcd_down = (member, time.monotonic() + ETCD_DOWN_S)
        elif fault.kind == "controller-kill":
            fault.target = self._kill_leader()
            self._controllers_started += 1
            self.run.add_controller(f"controller-{self._controllers_started - 1}")
        if fault.kind in CONSUMES_NODE:
            name = f"node-{self._nodes_started}"
            self._nodes_started += 1
            self.run.add_node(name, rack=f"rack-{self._nodes_started // 2}")

    def _worker_pid(self, node: str) -> int:
        client = self.run._client
        assert client is not None
        progress = read_progress(client, self.run.spec.name).get(keys.worker_id(node, 0))
        assert progress, f"no progress record for {node}"
        return progress.pid

    def _kill_leader(self) -> str:
        client = self.run._client
        assert client is not None
        kv = client.get(keys.controller_leader(self.run.spec.name))
        assert kv is not None, "no leader"
        pid = int(kv.value.decode().rsplit("-", 1)[1])
        name = next(n for n, p in self.run.procs.items() if p.popen.pid == pid)
        os.kill(pid, signal.SIGKILL)
        return name
