"""The node agent's restart tier: any torchrun script, restarted per generation.

A job whose ``fault_tolerance.recovery`` is ``restart`` runs an ordinary
torchrun script.  :class:`RestartTier` runs it for a
:class:`~agents.node.agent.NodeAgent` (in the agent's process):

* the agent keeps one pre-imported standby per local slot
  (:class:`~agents.node.warm_standby.WarmWorker`), on active and spare nodes alike;
* for each generation that includes this node it stops the workers it runs
  (the stop sequence of their process groups: SIGTERM, :data:`STOP_GRACE`,
  SIGKILL, so nothing a worker started outlives it) and launches new ones from the
  standbys with torchrun's environment for that generation
  (:func:`agents.node.torchrun_env.torchrun_env`), then starts fresh standbys in the background;
* ``MASTER_ADDR``/``MASTER_PORT``: the agent of the generation's rank-0 node
  picks a free port on its address, launches rank 0 (whose worker hosts the
  TCPStore there through ``env://``), publishes the address once that port
  listens and launches its other local ranks; the other agents wait for the
  address (or for a newer generation, or the end of the run) before they
  launch theirs (:mod:`agents.node.store_address`).  No store outlives its
  generation and no node is special across generations;
* a worker that exits 0 is recorded as done (the job succeeds when every
  worker of the generation is done).  Its standby says when the script has
  returned: a process still there :data:`RETURNED_GRACE` later is stuck in
  its teardown, so its group is killed (a ``WorkerKilled`` event says so) and
  the script's own exit code counts.  A worker that fails while its generation
  is current is reported, for every local worker, as a break of that
  generation with ``user_error`` set.  The controller tells a peer's death
  (a member's agent gone, a lease expired) from the script's own error, and
  publishes the next generation: a spare in a dead node's slot, or the same
  members again (a restart, up to ``max_restarts``).  A worker stopped because
  the generation moved on is never reported;
* the agent writes no step heartbeats: its registration says which
  generation it has launched and when the first of its new workers printed a
  line (``NodeRecord.progress_at``; a script often prints on rank 0 only, and a
  line after the relaunch is the group's first sign of training), which is how
  the controller sees a recovery end.  Workers that print nothing within
  :data:`FIRST_OUTPUT_WAIT` (or exit without a line) are reported as not
  telling (``progress_at`` None).
"""

from __future__ import annotations

import contextlib
import logging
import time

from agents.node.api import Outcome, PlanSource, TierSetup
from agents.node.break_reports import write_node_reports
from agents.node.store_address import AwaitedStore, PendingStore
from agents.node.torchrun_env import torchrun_env
from agents.node.warm_standby import WarmWorker
from agents.node.worker_exits import emit_worker_exited
from agents.node.worker_process import WorkerProcess, stop_workers
from orchestrator.api import EtcdError
from orchestrator.checkpoint_root.reach import ENV_CHECKPOINT_DIR, script_checkpoint_dir
from orchestrator.process_lifetime import free_port
from orchestrator.state import events, keys, records
from orchestrator.state.records import BreakReport, DoneRecord, Member, Plan

__all__ = [
    "FIRST_OUTPUT_WAIT",
    "RETURNED_GRACE",
    "RestartTier",
    "first_progress",
    "refill_delay",
]

log = logging.getLogger("ringmaster.agent")

#: Seconds a worker gets between SIGTERM and SIGKILL when its generation ends.
STOP_GRACE = 1.0
#: Seconds the workers get between SIGTERM and SIGKILL when the agent leaves.
LEAVE_GRACE = 5.0
#: Seconds after a job's first launch before the used standbys are replaced (so
#: importing torch for the next standby does not slow the new workers' start).
REFILL_DELAY = 1.0
#: The same after a relaunch (a recovery): long enough for the new workers to load
#: their checkpoint and take a step first.  Importing torch for two standbys beside
#: them slowed a 1 GB script's first step from 1.36 s to 2.13 s on a 2-core machine.
RECOVERY_REFILL_DELAY = 10.0
#: How often the agent reads the job's phase (it leaves when the job has ended).
PHASE_POLL = 0.5
#: Seconds a worker's process may run on after its script returned (atexit handlers,
#: open files flushed) before its group is killed and the script's own exit code taken.
RETURNED_GRACE = 30.0
#: Seconds after a launch the agent waits for a line of output from its new workers
#: before it reports the generation's progress as not told by the script.
FIRST_OUTPUT_WAIT = 30.0


class RestartTier:
    """The restart tier's supervision (see the module docstring).

    Args:
        setup: what it needs from its agent.
        address: this node's address (where a rank-0 worker's store listens).
        plans: where the newest plan is read (the agent's watches).
        returned_grace: seconds a worker's process may run on after its script
            returned before its group is killed (:data:`RETURNED_GRACE`).
    """

    def __init__(
        self,
        setup: TierSetup,
        address: str,
        plans: PlanSource,
        returned_grace: float = RETURNED_GRACE,
    ) -> None:
        self.setup = setup
        self.address = address
        self.plans = plans
        self.returned_grace = returned_grace
        self.leave_grace, self.stops_first = LEAVE_GRACE, False  # see :meth:`preempted`
        self.workers: dict[int, WorkerProcess] = {}
        #: the generation whose workers it launched last (or that left this node out)
        self.generation = 0
        self.launched_at: float | None = None
        #: when the first worker of the launched generation printed a line: 0.0
        #: while none has yet, None when not known (no launch, or silent workers)
        self.progress_at: float | None = None
        self._standbys: dict[int, WarmWorker] = {}
        self._broken_generation = 0
        self._refill_at: float | None = None
        #: the launch under way: rank 0's store to publish, or the address to wait for
        self._pending: PendingStore | AwaitedStore | None = None

    def start(self) -> None:
        self._refill_standbys()

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers.values()] + [s.pid for s in self._standbys.values()]

    def preempted(self, grace: float) -> None:
        """SIGTERM to the agent: the workers get ``grace`` s to exit, before it leaves."""
        self.leave_grace, self.stops_first = grace, True

    def close(self) -> None:
        stop_workers(self.workers.values(), self.leave_grace)
        for w in self.workers.values():
            if w.shipper is not None:
                w.shipper.join(timeout=2.0)  # the last lines reach etcd
        for standby in self._standbys.values():
            standby.discard()
        self._standbys.clear()

    # -- standbys ----------------------------------------------------------------------

    def _refill_standbys(self) -> None:
        """Start a standby for each slot that has none (or whose standby died)."""
        for i in range(self.setup.spec.nproc_per_node):
            if self.setup.stop.is_set():  # the agent is leaving: start nothing more
                return
            standby = self._standbys.get(i)
            if standby is None or not standby.alive():
                if standby is not None:
                    standby.discard()
                self._standbys[i] = WarmWorker(self.setup.worker_env(i), self.setup.workdir)
        self._refill_at = None

    # -- supervision -------------------------------------------------------------------

    def supervise(self) -> Outcome:
        """Follow the generations until the agent's run of the job ends; say why.

        Nothing here blocks: waiting for a generation's store is a state this loop
        looks at, so the end of the run (read every :data:`PHASE_POLL`) and a stop
        end every wait.
        """
        setup = self.setup
        next_phase_check = 0.0
        while not setup.stop.is_set():
            plan = self.plans.latest_plan
            if plan is not None and plan.generation > self.generation:
                self._switch(plan)
                continue
            self._advance_launch()
            self._note_progress()
            self._check_exits()
            if self._refill_at is not None and time.monotonic() >= self._refill_at:
                self._refill_standbys()
                setup.register()
            if time.monotonic() >= next_phase_check:
                next_phase_check = time.monotonic() + PHASE_POLL
                ended = setup.run_ended()
                if ended is not None:
                    return ended
            setup.stop.wait(0.01)
        return Outcome("stopped")

    def _switch(self, plan: Plan) -> None:
        """Stop this generation's workers; start launching the next one's if it
        includes this node (rank 0's node launches rank 0 now, the others wait for
        its store's address in :meth:`_advance_launch`)."""
        stop_workers(self.workers.values(), STOP_GRACE)
        self.workers.clear()
        self._pending = None
        self.generation = plan.generation
        self.launched_at = None
        member = plan.member(self.setup.node)
        self.progress_at = None if member is None else 0.0
        if member is None:
            self.setup.register()
            return
        self._clear_done(member)
        job = self.setup.job
        if member.rank_base == 0:
            master = (self.address, free_port(self.address))
            self._launch(plan, member, 0, master)
            self._pending = PendingStore.after_launch(job, plan, member, master)
        else:
            self._pending = AwaitedStore.for_plan(job, plan, member)
        self._advance_launch()

    def _launch_rest(
        self, plan: Plan, member: Member, slots: range, master: tuple[str, int]
    ) -> None:
        for i in slots:
            if self.setup.stop.is_set():
                return
            self._launch(plan, member, i, master)
        self.launched_at = time.time()
        log.info(
            "[%s] generation %d: started %d worker(s) (restart %d; store at %s:%d)",
            self.setup.node,
            plan.generation,
            member.nproc,
            max(plan.generation - 1, 0),
            *master,
        )
        self.setup.register()
        self._refill_at = time.monotonic() + refill_delay(plan.generation)

    def _advance_launch(self) -> None:
        """Take the launch under way one step further, if it can go on now."""
        pending, node = self._pending, self.setup.node
        if isinstance(pending, PendingStore) and pending.publish(self.setup.client, node):
            self._pending = None
            self._launch_rest(
                pending.plan, pending.member, range(1, pending.member.nproc), pending.master
            )
        elif isinstance(pending, AwaitedStore):
            master = pending.read(self.setup.client, node)
            if master is not None:
                self._pending = None
                self._launch_rest(pending.plan, pending.member, range(pending.member.nproc), master)

    def _note_progress(self) -> None:
        """Once a launched worker printed a line (or none will say), tell the controller."""
        if self.progress_at != 0 or self.launched_at is None or self._pending is not None:
            return
        workers = list(self.workers.values())
        seen = first_progress(
            self.launched_at,
            [w.first_output_at for w in workers],
            bool(workers) and all(w.exited_at is not None for w in workers),
            time.time(),
        )
        if seen != 0:
            self.progress_at = seen
            self.setup.register()

    def _newer_than(self, generation: int) -> bool:
        latest = self.plans.latest_plan
        return latest is not None and latest.generation > generation

    def _clear_done(self, member: Member) -> None:
        """Forget this node's workers' done records of earlier generations."""
        for i in range(member.nproc):
            with contextlib.suppress(EtcdError):
                self.setup.client.delete(
                    keys.job_done(self.setup.job) + keys.worker_id(self.setup.node, i)
                )

    def _launch(self, plan: Plan, member: Member, local_rank: int, master: tuple[str, int]) -> None:
        setup = self.setup
        standby = self._standbys.pop(local_rank, None)
        if standby is None or not standby.alive():
            if standby is not None:
                standby.discard()
            log.warning("[%s] no warm standby for slot %d: starting cold", setup.node, local_rank)
            standby = WarmWorker(setup.worker_env(local_rank), setup.workdir)
        error_file = setup.errors_dir / f"worker-{local_rank}-gen{plan.generation}.json"
        returned = error_file.with_suffix(".returned")
        env = setup.worker_env(local_rank)
        env[ENV_CHECKPOINT_DIR] = script_checkpoint_dir(setup.spec, setup.workdir)
        env.update(
            torchrun_env(
                job=setup.job,
                plan=plan,
                member=member,
                local_rank=local_rank,
                master=master,
                max_restarts=setup.spec.fault_tolerance.max_restarts,
                error_file=str(error_file),
            )
        )
        proc = standby.launch(setup.spec.entrypoint.command(), env, setup.workdir, returned)
        self.workers[local_rank] = WorkerProcess(
            local_rank,
            proc,
            error_file,
            setup.shipper(local_rank),
            generation=plan.generation,
            returned=returned,
        )

    def _check_exits(self) -> None:
        """Record finished workers; report a failure of the current generation once;
        end a worker whose script returned but whose process does not."""
        setup = self.setup
        for w in list(self.workers.values()):
            if w.exited_at is None:
                if w.end_after_return(self.returned_grace):
                    self._report_stuck(w)
                continue
            if w.exit_handled:
                continue
            w.exit_handled = True
            code = w.stop(0)  # reaped, and whatever it started goes with it
            returned = w.script_return()
            if returned is not None:
                code = returned.code  # the script's own, whatever its teardown did
            name = keys.worker_id(setup.node, w.local_rank)
            if code == 0:
                at = returned.at if returned is not None else w.exited_at
                done = DoneRecord(step=0, generation=w.generation, at=at)
                with contextlib.suppress(EtcdError):
                    records.write(setup.client, keys.job_done(setup.job) + name, done)
                continue
            if self._newer_than(w.generation):
                continue  # the generation moved on: not this worker's failure to report
            what = w.describe_exit()
            log.warning(
                "[%s] worker %s failed in generation %d (%s)", setup.node, name, w.generation, what
            )
            emit_worker_exited(
                setup.client, setup.job, setup.node, name, code, what, generation=w.generation
            )
            if self._broken_generation != w.generation:
                self._broken_generation = w.generation
                self._report_break(w.generation, what, w.exited_at)

    def _report_stuck(self, w: WorkerProcess) -> None:
        """Say that a worker's group was killed after its script returned."""
        setup = self.setup
        returned = w.script_return()
        code = returned.code if returned is not None else 0
        name = keys.worker_id(setup.node, w.local_rank)
        message = (
            f"{name}: its script returned (exit code {code}) but its process was still "
            f"running {self.returned_grace:g}s later (stuck in teardown); its process "
            f"group was killed and the script's exit code counts"
        )
        log.warning("[%s] %s", setup.node, message)
        with contextlib.suppress(Exception):
            events.emit(
                setup.client,
                setup.job,
                "WorkerKilled",
                message,
                source=setup.node,
                worker=name,
                generation=w.generation,
                exit_code=code,
            )

    def _report_break(self, generation: int, reason: str, at: float) -> None:
        """Report the generation broken for every local worker (the node speaks for all)."""
        setup = self.setup
        report = BreakReport(step=0, reason=reason, planned=False, at=at, user_error=True)
        workers = range(setup.spec.nproc_per_node)
        reports = {keys.worker_id(setup.node, i): report for i in workers}
        try:
            write_node_reports(setup.client, setup.job, generation, setup.node, reports)
        except EtcdError as e:
            log.warning("[%s] could not report the failure: %s", setup.node, e)


def refill_delay(generation: int) -> float:
    """Seconds after launching ``generation`` before the used standbys are replaced."""
    return REFILL_DELAY if generation <= 1 else RECOVERY_REFILL_DELAY


def first_progress(
    launched_at: float,
    firsts: list[float | None],
    all_exited: bool,
    now: float,
    wait: float = FIRST_OUTPUT_WAIT,
) -> float | None:
    """What a node reports of its launched workers' progress (``NodeRecord.progress_at``).

    Args:
        launched_at: when the generation's workers were launched.
        firsts: when each printed its first line (None: not yet).
        all_exited: every one of them has exited.
        now: the time now.
        wait: :data:`FIRST_OUTPUT_WAIT`.

    Returns:
        The time the first of them printed a line; 0.0 while one may still; None
        when none will tell (silent past ``wait``, or all exited without a line).
    """
    seen = [f for f in firsts if f is not None]
    if seen:
        return min(seen)
    if all_exited or now - launched_at > wait:
        return None
    return 0.0
