"""The node agent's in-process tier: workers that run the whole job, restarted on an error.

Runs in the node agent.  A job whose ``fault_tolerance.recovery`` is
``in_process`` runs a script that uses :mod:`agents.runtime`; its workers
survive a peer's death by themselves (they join the next generation), so the
agent only:

* starts ``nproc_per_node`` workers, each in a process group of its own
  (:class:`~agents.node.worker_process.WorkerProcess`);
* restarts a worker that exits with an error (up to ``max_restarts``),
  reporting the exit code or signal and the root cause from its error file
  (a ``WorkerExited`` event); the restarted worker rejoins as a spare and gets
  its state from a live peer.  What the old worker left behind is killed with it;
* leaves when every worker has finished, when a worker has used up its
  restarts, or, once preempted, when a checkpoint was committed after the
  preemption (or the grace period passed without one).  Once the agent's run
  of the job is over (its phase final, or a newer run started), the workers
  get :data:`ENDED_GRACE` to end by themselves (they do, normally: a worker
  waiting for a plan sees the phase), then the agent leaves and stops them.
  While a worker that recorded the end of its training loop runs on (it is in
  the rest of its script: a final evaluation, an export), the agent waits for
  its workers to exit, as torchrun waits for its workers, for up to the job's
  ``fault_tolerance.hang_timeout`` after the run ended.
"""

from __future__ import annotations

import logging
import sys
import time

from agents.node.api import Outcome, TierSetup
from agents.node.worker_exits import emit_worker_exited
from agents.node.worker_process import WorkerProcess, stop_workers
from orchestrator.api import EtcdError
from orchestrator.state import keys, records
from orchestrator.state.api import RecordError
from orchestrator.state.records import CheckpointRecord, DoneRecord

__all__ = ["InProcessTier"]

log = logging.getLogger("ringmaster.agent")

#: How often workers are polled.
POLL = 0.05
#: Seconds the workers get between SIGTERM and SIGKILL when the agent leaves.
STOP_GRACE = 5.0
#: How often the agent reads the job's phase.
PHASE_POLL = 0.5
#: Seconds the workers may run on once the agent's run of the job is over.
ENDED_GRACE = 10.0


class InProcessTier:
    """The in-process tier's supervision (see the module docstring)."""

    def __init__(self, setup: TierSetup) -> None:
        self.setup = setup
        self.workers: dict[int, WorkerProcess] = {}
        self.generation = 0  # the workers follow the generations themselves
        self.launched_at: float | None = None
        self.progress_at: float | None = None  # the workers report their steps themselves
        self._preempted_at: float | None = None
        #: workers (local rank, start time) seen past their training loop
        self._past_loop: set[tuple[int, float]] = set()

    def start(self) -> None:
        """Start every worker (the agent registers them once all are up); a stop ends
        the starting at once."""
        for i in range(self.setup.spec.nproc_per_node):
            if self.setup.stop.is_set():
                return
            self._start_worker(i, register=False)

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers.values()]

    def preempt(self, at: float) -> None:
        """The node is preempted (``at``: ``time.monotonic()``): leave once a checkpoint
        committed after it, or when the grace period ends without one."""
        self._preempted_at = at

    def supervise(self) -> Outcome:
        """Watch the workers until the agent should leave; say why."""
        setup = self.setup
        max_restarts = setup.spec.fault_tolerance.max_restarts
        grace = setup.spec.fault_tolerance.preemption_grace.total_seconds()
        next_phase_check = 0.0
        ended_at: float | None = None  # when the run was first seen over
        while not setup.stop.is_set():
            preempted = self._preempted_at
            if preempted is not None and time.monotonic() - preempted > grace:
                return Outcome(
                    f"preempted; no checkpoint committed within the {grace:g}s grace",
                    lost_work=True,
                )
            finished = 0
            for w in list(self.workers.values()):
                code = w.exit_code()
                if code is None:
                    continue
                w.stop(0)  # reaped, and whatever it started goes with it
                if code == 0:
                    finished += 1
                    continue
                ended = self._on_worker_failure(w, code, max_restarts)
                if ended is not None:
                    return ended
            if finished == len(self.workers):
                ended = setup.run_ended()
                return Outcome("workers finished" + (f" ({ended.reason})" if ended else ""))
            if preempted is not None and self._saved_since(preempted):
                return Outcome("preempted; checkpoint committed")
            if time.monotonic() >= next_phase_check:
                next_phase_check = time.monotonic() + PHASE_POLL
                ended = setup.run_ended()
                if ended is None:
                    ended_at = None
                elif ended_at is None:
                    ended_at = time.monotonic()
                elif (over := time.monotonic() - ended_at) >= ENDED_GRACE and (
                    over >= self._ended_grace()
                ):
                    running = len(self.workers) - finished
                    return Outcome(
                        f"{ended.reason}; {running} worker(s) still running "
                        f"{over:.0f}s later are stopped",
                        exit_code=ended.exit_code,
                    )
            setup.stop.wait(POLL)
        return Outcome("stopped")

    def _ended_grace(self) -> float:
        """Seconds the workers may run on once the run is over: :data:`ENDED_GRACE`, or
        the job's hang timeout while a running worker is past its training loop (once
        seen so, a worker stays so: a failed read later does not shorten its time)."""
        setup = self.setup
        long = max(ENDED_GRACE, setup.spec.fault_tolerance.hang_timeout.total_seconds())
        for w in self.workers.values():
            if w.exit_code() is not None:
                continue
            if (w.local_rank, w.started_at) in self._past_loop:
                return long
            key = keys.job_done(setup.job) + keys.worker_id(setup.node, w.local_rank)
            try:
                done = records.read(setup.client, key, DoneRecord)
            except (EtcdError, RecordError):
                continue  # not known to be done: the short grace
            if done is not None and done.at >= w.started_at:
                self._past_loop.add((w.local_rank, w.started_at))
                return long
        return ENDED_GRACE

    def close(self) -> None:
        stop_workers(self.workers.values(), STOP_GRACE)
        for w in self.workers.values():
            if w.shipper is not None:
                w.shipper.join(timeout=2.0)  # the last lines reach etcd

    def _start_worker(self, local_rank: int, restarts: int = 0, register: bool = True) -> None:
        setup = self.setup
        env = setup.worker_env(local_rank)
        error_file = setup.errors_dir / f"worker-{local_rank}-{restarts}.json"
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
        self.workers[local_rank] = WorkerProcess.start(
            [sys.executable, *setup.spec.entrypoint.command()],
            env=env,
            cwd=setup.workdir,
            local_rank=local_rank,
            error_file=error_file,
            shipper=setup.shipper(local_rank),
            restarts=restarts,
        )
        if register:  # a restarted worker's pid goes into the registration at once
            setup.register()

    def _on_worker_failure(self, w: WorkerProcess, code: int, max_restarts: int) -> Outcome | None:
        setup = self.setup
        what = w.describe_exit()
        name = keys.worker_id(setup.node, w.local_rank)
        log.warning("[%s] worker %s failed (%s)", setup.node, name, what)
        ended = setup.run_ended()
        emit_worker_exited(setup.client, setup.job, setup.node, name, code, what)
        if ended is not None:
            self.workers.pop(w.local_rank)
            return None
        if w.restarts >= max_restarts:
            log.error("[%s] %s exhausted %d restarts", setup.node, name, max_restarts)
            return Outcome(f"{name} exhausted {max_restarts} restarts", exit_code=1)
        self._start_worker(w.local_rank, w.restarts + 1)
        return None

    def _saved_since(self, preempted: float) -> bool:
        """A checkpoint was committed after the preemption (``time.monotonic()``)."""
        key = keys.job_checkpoint(self.setup.job)
        try:
            record = records.read(self.setup.client, key, CheckpointRecord)
        except EtcdError:
            return False
        except RecordError as e:  # not proof of a save: wait out the grace period
            log.warning("[%s] checkpoint record unreadable: %s", self.setup.node, e)
            return False
        since = time.time() - (time.monotonic() - preempted)
        return record is not None and record.at >= since
