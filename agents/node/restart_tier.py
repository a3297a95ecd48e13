"""The node agent's restart tier: any torchrun script, restarted per generation.

A job whose ``fault_tolerance.recovery`` is ``restart`` runs an ordinary
torchrun script.  :class:`RestartTier` is the part of
:class:`~agents.node.agent.NodeAgent` that runs it:

* the agent keeps one pre-imported standby per local slot
  (:class:`~agents.node.warm_standby.WarmWorker`), on active and spare nodes alike;
* for each generation that includes this node it stops the workers it runs
  (SIGTERM, :data:`STOP_GRACE`, SIGKILL) and launches new ones from the
  standbys with torchrun's environment for that generation
  (:func:`torchrun_env`), then starts fresh standbys in the background;
* ``MASTER_ADDR``/``MASTER_PORT``: the agent of the generation's rank-0 node
  picks a free port on its address, launches rank 0 (whose worker hosts the
  TCPStore there through ``env://``) and, once that port listens, publishes
  ``host:port`` under the generation's key
  (``/ringmaster/jobs/<job>/pg/<gen>/master``) and launches its other local
  ranks; the other agents wait for that key (or for a newer generation)
  before they launch theirs.  A store client that comes before its server
  retries after a random backoff of up to half a second here, so waiting for
  the port is faster than racing it.  No store outlives its generation and no
  node is special across generations;
* a worker that exits 0 is recorded as done (the job succeeds when every
  worker of the generation is done); a worker that fails while its generation
  is current is reported, for every local worker, as a break of that
  generation with ``user_error`` set.  The controller tells a peer's death
  (a member's agent gone, a lease expired) from the script's own error, and
  publishes the next generation: a spare in a dead node's slot, or the same
  members again (a restart, up to ``max_restarts``).  A worker stopped because
  the generation moved on is never reported;
* the agent writes no step heartbeats: its registration says which
  generation it has launched, which is how the controller sees a recovery end.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agents.api import ENV_RECOVERY, RECOVERY_RESTART
from agents.node.break_reports import write_node_reports
from agents.node.log_shipper import LogShipper
from agents.node.warm_standby import WarmWorker
from agents.node.worker_exits import describe_failure, emit_worker_exited
from orchestrator import keys, records
from orchestrator.api import EtcdError, JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.process_lifetime import free_port
from orchestrator.records import BreakReport, DoneRecord, Member, Plan
from orchestrator.spec import JobSpec

if TYPE_CHECKING:
    from agents.node.agent import _Worker

log = logging.getLogger("ringmaster.agent")

#: Where the script keeps its own checkpoints (see :func:`checkpoint_dir`).
ENV_CHECKPOINT_DIR = "RINGMASTER_CHECKPOINT_DIR"
#: torchrun's default role name.
ROLE_NAME = "default"
#: Seconds a worker gets between SIGTERM and SIGKILL when its generation ends.
STOP_GRACE = 1.0
#: Seconds after a launch before the used standbys are replaced (so importing
#: torch for the next standby does not slow the new workers' start).
REFILL_DELAY = 1.0
#: How often a waiting agent looks for the generation's store address.
MASTER_POLL = 0.02
#: How often the agent reads the job's phase (it leaves when the job has ended).
PHASE_POLL = 0.5
#: Seconds rank 0's agent waits for the store port to listen before it publishes
#: the address anyway (a script may do much work before init_process_group).
PUBLISH_FALLBACK = 2.0


def torchrun_env(
    *,
    job: str,
    plan: Plan,
    member: Member,
    local_rank: int,
    master: tuple[str, int],
    max_restarts: int,
    error_file: str,
) -> dict[str, str]:
    """The variables torchrun gives a worker, for one generation.

    Ranks follow the plan: ``member``'s workers take ``rank_base + local_rank``;
    ``GROUP_RANK`` is the member's place in the plan.  The restart count is
    the generation's (every new generation restarts every worker), so it is
    the same on every rank, a spare's included.
    """
    rank = member.rank_base + local_rank
    world = plan.world_size
    group_rank = next(i for i, m in enumerate(plan.members) if m.node == member.node)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": ROLE_NAME,
        "ROLE_WORLD_SIZE": str(world),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(member.nproc),
        "GROUP_WORLD_SIZE": str(len(plan.members)),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_RUN_ID": job,
        "TORCHELASTIC_RESTART_COUNT": str(max(plan.generation - 1, 0)),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        ENV_RECOVERY: RECOVERY_RESTART,
    }


def checkpoint_dir(spec: JobSpec, workdir: str) -> str:
    """``RINGMASTER_CHECKPOINT_DIR``: ``<checkpoint.url>/script``.

    A local URL (``file://``, or a plain path) becomes a directory path,
    relative ones taken from ``workdir``; any other URL (``s3://...``) is given
    as a URL, for a script that saves through fsspec.
    """
    url = spec.checkpoint.url
    if "://" in url and not url.startswith("file://"):
        return url.rstrip("/") + "/script"
    path = Path(url.removeprefix("file://"))
    if not path.is_absolute():
        path = Path(workdir) / path
    return str(path / "script")


def listening(port: int) -> bool:
    """Whether a local TCP socket listens on ``port`` (``/proc/net/tcp*``; no connection
    is made).  True where that cannot be read (not Linux): then nobody waits for it."""
    seen = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for row in rows:
            fields = row.split()  # sl, local address:port (hex), remote, state (0A: LISTEN)
            local_port = int(fields[1].rsplit(":", 1)[1], 16) if len(fields) > 3 else -1
            if local_port == port and fields[3] == "0A":
                return True
    return not seen


@dataclass
class PendingStore:
    """Rank 0 is launched; its store address is published once the port listens."""

    plan: Plan
    member: Member
    key: str
    master: tuple[str, int]
    deadline: float


class RestartTier:
    """The restart tier's half of a node agent (see the module docstring)."""

    client: EtcdClient
    job: str
    node: str
    address: str
    workdir: str
    spec: JobSpec | None
    workers: dict[int, _Worker]
    exit_code: int
    _stop: threading.Event
    _errors_dir: Path | None
    _latest_plan: Plan | None
    _standbys: dict[int, WarmWorker]
    _launched_generation: int
    _launched_at: float | None
    _broken_generation: int
    _refill_at: float | None
    _pending_store: PendingStore | None

    def _worker_env(self, local_rank: int) -> dict[str, str]:
        raise NotImplementedError

    def _safe_register(self) -> None:
        raise NotImplementedError

    def _job_phase(self) -> JobPhase | None:
        raise NotImplementedError

    # -- standbys ----------------------------------------------------------------------

    def _refill_standbys(self) -> None:
        """Start a standby for each slot that has none (or whose standby died)."""
        assert self.spec is not None
        for i in range(self.spec.nproc_per_node):
            standby = self._standbys.get(i)
            if standby is None or not standby.alive():
                if standby is not None:
                    standby.discard()
                self._standbys[i] = WarmWorker(self._worker_env(i), self.workdir)
        self._refill_at = None

    def _discard_standbys(self) -> None:
        for standby in self._standbys.values():
            standby.discard()
        self._standbys.clear()

    # -- supervision -------------------------------------------------------------------

    def _supervise_restart(self) -> str:
        """Follow the generations until the job ends; returns why the agent leaves."""
        next_phase_check = 0.0
        while not self._stop.is_set():
            plan = self._latest_plan
            if plan is not None and plan.generation > self._launched_generation:
                self._switch(plan)
                continue
            self._publish_store()
            self._check_exits()
            if self._refill_at is not None and time.monotonic() >= self._refill_at:
                self._refill_standbys()
                self._safe_register()
            if time.monotonic() >= next_phase_check:
                next_phase_check = time.monotonic() + PHASE_POLL
                phase = self._job_phase()
                if phase is not None and phase.terminal:
                    if phase is JobPhase.FAILED:
                        self.exit_code = 1
                    return f"job {phase.value}"
            self._stop.wait(0.01)
        return "stopped"

    def _switch(self, plan: Plan) -> None:
        """Stop this generation's workers; launch the next one's if it includes this node."""
        self._stop_running(STOP_GRACE)
        self._pending_store = None
        self._launched_generation = plan.generation
        member = plan.member(self.node)
        if member is None:
            self._safe_register()
            return
        self._clear_done(member)
        key = keys.pg_store(self.job, plan.generation) + "master"
        if member.rank_base == 0:
            master = (self.address, free_port(self.address))
            self._launch(plan, member, 0, master)
            deadline = time.monotonic() + PUBLISH_FALLBACK
            self._pending_store = PendingStore(plan, member, key, master, deadline)
            self._publish_store()
            return
        found = self._wait_for_store(plan, key)
        if found is None:
            return  # a newer generation came first (or the agent stops)
        self._launch_rest(plan, member, range(member.nproc), found)

    def _launch_rest(
        self, plan: Plan, member: Member, slots: range, master: tuple[str, int]
    ) -> None:
        for i in slots:
            self._launch(plan, member, i, master)
        self._launched_at = time.time()
        log.info(
            "[%s] generation %d: started %d worker(s) (restart %d; store at %s:%d)",
            self.node,
            plan.generation,
            member.nproc,
            max(plan.generation - 1, 0),
            *master,
        )
        self._safe_register()
        self._refill_at = time.monotonic() + REFILL_DELAY

    def _publish_store(self) -> None:
        """Rank 0's node: publish the store address once rank 0 listens (or the fallback
        time passed), then launch the other local ranks."""
        pending = self._pending_store
        if pending is None:
            return
        if self._newer_than(pending.plan):
            self._pending_store = None
            return
        port = pending.master[1]
        if not listening(port) and time.monotonic() < pending.deadline:
            return
        try:
            self.client.put(pending.key, f"{pending.master[0]}:{port}")
        except EtcdError as e:
            log.warning("[%s] publishing the store address (will retry): %s", self.node, e)
            return
        self._pending_store = None
        self._launch_rest(pending.plan, pending.member, range(1, pending.member.nproc),
                          pending.master)  # fmt: skip

    def _stop_running(self, grace: float) -> None:
        """SIGTERM the running workers, SIGKILL those still there after ``grace``."""
        running = [w for w in self.workers.values() if w.proc.poll() is None]
        for w in running:
            with contextlib.suppress(ProcessLookupError):
                w.proc.terminate()
        deadline = time.monotonic() + grace
        for w in running:
            try:
                w.proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:  # still running after the grace
                w.proc.kill()
                w.proc.wait()
        self.workers.clear()

    def _wait_for_store(self, plan: Plan, key: str) -> tuple[str, int] | None:
        """``(host, port)`` of the generation's store once rank 0's agent published it;
        None when a newer generation (or a stop) came first."""
        while not self._stop.is_set() and not self._newer_than(plan):
            try:
                kv = self.client.get(key)
            except EtcdError as e:
                log.debug("[%s] waiting for %s: %s", self.node, key, e)
                kv = None
            if kv is not None:
                host, _, number = kv.value.decode().rpartition(":")
                return host, int(number)
            self._stop.wait(MASTER_POLL)
        return None

    def _newer_than(self, plan: Plan) -> bool:
        latest = self._latest_plan
        return latest is not None and latest.generation > plan.generation

    def _clear_done(self, member: Member) -> None:
        """Forget this node's workers' done records of earlier generations."""
        for i in range(member.nproc):
            with contextlib.suppress(EtcdError):
                self.client.delete(keys.job_done(self.job) + keys.worker_id(self.node, i))

    def _launch(self, plan: Plan, member: Member, local_rank: int, master: tuple[str, int]) -> None:
        from agents.node.agent import _Worker

        assert self.spec is not None and self._errors_dir is not None
        standby = self._standbys.pop(local_rank, None)
        if standby is None or not standby.alive():
            if standby is not None:
                standby.discard()
            log.warning("[%s] no warm standby for slot %d: starting cold", self.node, local_rank)
            standby = WarmWorker(self._worker_env(local_rank), self.workdir)
        error_file = self._errors_dir / f"worker-{local_rank}-gen{plan.generation}.json"
        env = self._worker_env(local_rank)
        env[ENV_CHECKPOINT_DIR] = checkpoint_dir(self.spec, self.workdir)
        env.update(
            torchrun_env(
                job=self.job,
                plan=plan,
                member=member,
                local_rank=local_rank,
                master=master,
                max_restarts=self.spec.fault_tolerance.max_restarts,
                error_file=str(error_file),
            )
        )
        proc = standby.launch(self.spec.entrypoint.command(), env, self.workdir)
        assert proc.stdout is not None
        shipper = LogShipper(self.client, self.job, self.node, local_rank, sys.stdout.buffer)
        shipper.start(proc.stdout)
        w = _Worker(local_rank, proc, error_file, shipper, generation=plan.generation)
        self.workers[local_rank] = w
        threading.Thread(target=_note_exit, args=(w,), name="exit", daemon=True).start()

    def _check_exits(self) -> None:
        """Record finished workers; report a failure of the current generation once."""
        for w in list(self.workers.values()):
            if w.exited_at is None or w.exit_seen:
                continue
            w.exit_seen = True
            code = w.proc.returncode
            name = keys.worker_id(self.node, w.local_rank)
            if code == 0:
                done = DoneRecord(step=0, generation=w.generation, at=w.exited_at)
                with contextlib.suppress(EtcdError):
                    records.write(self.client, keys.job_done(self.job) + name, done)
                continue
            if self._newer_than_generation(w.generation):
                continue  # the generation moved on: not this worker's failure to report
            what = describe_failure(code, w.error_file, w.shipper)
            log.warning("[%s] worker %s failed in generation %d (%s)", self.node, name,
                        w.generation, what)  # fmt: skip
            emit_worker_exited(
                self.client, self.job, self.node, name, code, what, generation=w.generation
            )
            if self._broken_generation != w.generation:
                self._broken_generation = w.generation
                self._report_break(w.generation, what, w.exited_at)

    def _newer_than_generation(self, generation: int) -> bool:
        latest = self._latest_plan
        return latest is not None and latest.generation > generation

    def _report_break(self, generation: int, reason: str, at: float) -> None:
        """Report the generation broken for every local worker (the node speaks for all)."""
        assert self.spec is not None
        report = BreakReport(step=0, reason=reason, planned=False, at=at, user_error=True)
        workers = range(self.spec.nproc_per_node)
        reports = {keys.worker_id(self.node, i): report for i in workers}
        try:
            write_node_reports(self.client, self.job, generation, self.node, reports)
        except EtcdError as e:
            log.warning("[%s] could not report the failure: %s", self.node, e)


def _note_exit(w: _Worker) -> None:
    """Wait for the worker and note when it exited (which failure came first matters)."""
    w.proc.wait()
    w.exited_at = time.time()
