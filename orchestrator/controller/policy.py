"""The controller's decisions, as a pure function of a snapshot of the world.

Over 450 lines, kept whole: :func:`decide` is one ordered pass over the rules
below, and the order is the policy; the rules that stand apart (plans, breaks,
placement, hangs, commands, stragglers, site balance) are in their own modules.

:func:`decide` takes the job spec, the policy's own memory (timers kept
across ticks), the job status and a :class:`~orchestrator.controller.world.World`
and returns the new memory, the new status and a list of actions
(:mod:`orchestrator.controller.actions`).  It reads no clock (times come in
the snapshot) and does no I/O, so it is tested through a table of scenarios
without etcd (``tests/unit/test_controller_policy.py``).

Per job it:

* starts the job when ``nodes.max`` nodes are warm (or ``nodes.min`` after
  the last-call timeout), in topology order, the rest as warm spares;
* on a break (workers reported the generation broken) replaces the members
  the rules of :mod:`orchestrator.controller.breaks` name (a refused liveness
  probe at once, a late member never, the rest after ``REPORT_GRACE``), a
  member whose agent's watch closed unannounced (before any report), and a
  member whose registration lease expired;
* kills a worker whose heartbeat stopped for 3 heartbeat intervals (a frozen
  process; not when every heartbeat stopped at once: then their way to etcd
  is stuck, and the workers pause for that);
* puts a warm spare from the failed node's rack (then zone) in its place
  (:mod:`orchestrator.controller.plans`); scales down to ``nodes.min`` when no
  spare is left and fails the job when fewer than ``nodes.min`` remain for
  ``rendezvous.join_timeout``; scales a running generation below ``nodes.max``
  up again with the nodes that join (a failed node's agent started again, a
  node late for the start; the in-process tier only);
* keeps the sites of one size, once a worker reported that its model is sharded
  in each site (:mod:`orchestrator.controller.site_balance`);
* treats a step that raised an error of the training script's own (a break
  report with ``user_error``, while no member's agent is gone) as the script's
  failure, not a peer's: the job restarts in a new generation up to
  ``fault_tolerance.max_restarts`` times, then fails with the script's
  message (a fault of its checkpoints: at once); no recovery is recorded;
* pauses (phase ``Paused``) after an etcd outage and declares nobody dead
  for ``OUTAGE_GRACE`` after it; relays stop and checkpoint commands.

A job in the restart tier (``fault_tolerance.recovery: restart``, plain
torchrun scripts; see :mod:`agents.node.restart_tier`) is decided the same way,
with what its agents write in place of the runtime's heartbeats: a node is
ready once its agent registered (its standbys are started), a break report
comes from an agent for all its workers when one exits with an error, and a
recovery ends when every member's agent has launched the new generation's
workers.  Silent members get ``REPORT_GRACE`` to report first, so the job's
message names the script's own error rather than a peer's broken collective; a
node's failure is told before the errors it caused; rank 0 stays on a survivor.
A stop ends such a job at once (the script has no step boundary to stop at).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from orchestrator.api import JobPhase
from orchestrator.controller import breaks, plans
from orchestrator.controller.actions import (
    Action,
    CheckpointCommitted,
    DeclareFailed,
    Emit,
    FailureSeen,
    PhaseChanged,
    PublishPlan,
    Recovered,
)
from orchestrator.controller.commands import take_commands
from orchestrator.controller.hangs import hung_workers
from orchestrator.controller.memory import Memory
from orchestrator.controller.plans import (
    is_warm,
    make_plan,
    restart_tier,
    start_members,
    start_ready,
    startup_failure,
    storage_split,
    survivor_first,
    swap_in_spares,
    topology_ordered,
    trains_again,
)
from orchestrator.controller.site_balance import balanced_order
from orchestrator.controller.world import World, silent_members, workers_of
from orchestrator.observe.endings import unsaved
from orchestrator.settings import SETTINGS
from orchestrator.spec.job import JobSpec, RecoveryMode
from orchestrator.state.records import JobStatus, Plan

#: After an outage, how long lease expiry and stale heartbeats are not taken as failures
#: (agents re-register and workers beat again within a lease TTL or two).
OUTAGE_GRACE = SETTINGS.outage_grace


@dataclass
class Decision:
    memory: Memory
    status: JobStatus
    actions: list[Action]


def decide(spec: JobSpec, memory: Memory, status: JobStatus, world: World) -> Decision:
    """One tick of the controller's reasoning; inputs are not modified."""
    d = _Decider(spec, copy.deepcopy(memory), dataclasses.replace(status), world)
    d.run()
    return Decision(d.memory, d.status, d.actions)


class _Decider:
    def __init__(self, spec: JobSpec, memory: Memory, status: JobStatus, world: World) -> None:
        self.spec = spec
        self.m = memory
        self.status = status
        self.status.active_nodes = list(status.active_nodes)
        self.status.spare_nodes = list(status.spare_nodes)
        self.status.failed_nodes = list(status.failed_nodes)
        self.w = world
        self.control = world.control
        self.actions: list[Action] = []

    @property
    def memory(self) -> Memory:
        return self.m

    def phase(self, phase: JobPhase, message: str, **data: object) -> None:
        self.status.message = message
        if phase is self.status.phase or not self.status.phase.can_move_to(phase):
            return
        self.status.phase = phase
        self.actions.append(PhaseChanged(phase, message, dict(data)))

    def in_grace(self) -> bool:
        return self.w.mono < self.m.grace_until

    @property
    def restart_tier(self) -> bool:
        return restart_tier(self.spec, self.w.nodes)

    def warm(self, node: str) -> bool:
        return is_warm(self.spec, self.w, node, self.restart_tier)

    def warm_nodes(self, but: set[str]) -> list[str]:
        """The warm nodes other than ``but``, in topology order."""
        every = topology_ordered(self.spec, self.w, list(self.w.nodes))
        return [n for n in every if n not in but and self.warm(n)]

    def make_plan(self, generation: int, order: list[str], spares: list[str], why: str) -> Plan:
        return make_plan(self.spec, self.w, generation, order, spares, why)

    def short_too_long(self, what: str, advice: str) -> bool:
        """Fewer nodes than ``nodes.min``: fail the job once that lasted ``join_timeout``."""
        self.m.short_since = self.m.short_since or self.w.mono
        limit = self.spec.rendezvous.join_timeout.total_seconds()
        if self.w.mono - self.m.short_since <= limit:
            return False
        self.phase(JobPhase.FAILED, f"{what} for {limit:g}s (rendezvous.join_timeout); {advice}")
        return True

    # -- the tick ----------------------------------------------------------------------

    def run(self) -> None:
        if self.status.phase.terminal:
            return
        self.commands()
        if self.status.phase.terminal:
            return
        if self.w.plan is None:
            self.maybe_start()
            return
        if self.status.phase is JobPhase.PENDING:
            # the leader before published the first generation and ended before it
            # recorded the start: the job runs (else it could never succeed or fail)
            active = ", ".join(m.node for m in self.w.plan.members)
            self.phase(JobPhase.RUNNING, f"started with {len(self.w.plan.members)} nodes: {active}")
        self.notice_outage()
        self.end_pause()
        self.watch_running(self.w.plan)

    def commands(self) -> None:
        actions, self.control = take_commands(self.w.commands, self.w.control)
        self.actions += actions
        if self.control.stop and self.w.plan is None:
            self.phase(JobPhase.STOPPED, "stopped before it started")

    def maybe_start(self) -> None:
        warm = [n for n in self.w.nodes if self.warm(n)]
        need_max, need_min = self.spec.nodes.max, self.spec.nodes.min
        now = self.w.mono
        if len(warm) >= need_min and self.m.min_reached_at is None:
            self.m.min_reached_at = now
        since_min = None if self.m.min_reached_at is None else now - self.m.min_reached_at
        ready = start_ready(self.spec, self.w, warm, since_min)
        self.status.message = f"waiting for nodes: {len(warm)} ready, need {need_min}..{need_max}"
        if self.failed_to_start(warm):
            return
        if not ready:
            self.short_too_long(
                f"only {len(warm)} of the {need_min} nodes needed were ready",
                f"see `ringmaster logs {self.status.name}` and `ringmaster events` for why "
                "nodes did not come up",
            )
            return
        self.m.short_since = None
        active, spares = start_members(self.spec, self.w, warm)
        self.actions.append(PublishPlan(self.make_plan(1, active, spares, "start")))
        self.phase(JobPhase.RUNNING, f"started with {len(active)} nodes: {', '.join(active)}")

    def failed_to_start(self, warm: list[str]) -> bool:
        """Fail the job when it cannot start (:func:`startup_failure`, :func:`storage_split`)."""
        why = startup_failure(self.spec, self.w, warm) or storage_split(self.w, warm)
        if why is not None:
            self.phase(JobPhase.FAILED, why)
        return why is not None

    def notice_outage(self) -> None:
        silence = self.w.silence
        if silence is None or silence == self.m.silence_seen:
            return
        self.m.silence_seen = silence
        seconds = silence[1]
        self.m.grace_until = self.w.mono + OUTAGE_GRACE.total_seconds()
        self.m.break_generation = None  # report timing from before the outage means nothing
        phase = self.status.phase
        if phase.terminal or phase is JobPhase.PENDING:
            return
        if phase is not JobPhase.PAUSED:
            self.m.paused_from = phase
        self.phase(
            JobPhase.PAUSED,
            f"paused: etcd was unavailable (no quorum, unreachable, stalled or out of "
            f"space) for "
            f"{seconds:.1f}s; workers hold their state at a step boundary. No failures are "
            f"declared for {OUTAGE_GRACE.total_seconds():g}s while nodes re-register",
            outage_s=round(seconds, 2),
        )

    def end_pause(self) -> None:
        if self.status.phase is JobPhase.PAUSED and not self.in_grace():
            back = self.m.paused_from or JobPhase.RUNNING
            self.m.paused_from = None
            self.phase(back, "resumed after the etcd outage")

    def watch_running(self, plan: Plan) -> None:
        w, status = self.w, self.status
        status.recovery = (
            RecoveryMode.RESTART.value if self.restart_tier else RecoveryMode.IN_PROCESS.value
        )
        members = {m.node for m in plan.members}
        workers = workers_of(plan)
        status.generation = plan.generation
        status.world_size = plan.world_size
        status.active_nodes = [m.node for m in plan.members]
        status.spare_nodes = [
            n for n in w.nodes if n not in members and n not in w.dead and self.warm(n)
        ]
        record = w.checkpoint
        if record is not None and record.at != status.last_checkpoint_at:
            status.last_checkpoint = f"step {record.step} ({record.reason})"
            for commit in record.unseen(status.last_checkpoint_at):
                self.actions.append(CheckpointCommitted(commit, late=commit is not record))
            status.last_checkpoint_at = record.at
        # a done record may be newer than the last heartbeat read (two reads apart)
        steps = [w.progress[x].step for x in workers if x in w.progress]
        steps += [w.done[x].step for x in workers if x in w.done]
        if steps:
            status.step = max(status.step, max(steps))
        last = self.spec.max_steps
        finished_all = last > 0 and any(r.step >= last for r in w.done.values())
        all_done = bool(workers) and all(x in w.done for x in workers)
        if self.control.stop and self.restart_tier:
            self.phase(
                JobPhase.STOPPED,
                "stopped on request; the workers were stopped (the script resumes from its "
                "own checkpoint when the job runs again)",
            )
            return
        # A stop wins over "all done": the workers end their loops on the stop.
        if self.control.stop and (all_done or all(x in w.done for x in workers if x in w.progress)):
            steps = sorted({r.step for r in w.done.values()})
            self.phase(JobPhase.STOPPED, f"stopped on request at step {max(steps, default=0)}")
            return
        if all_done or finished_all:
            # whoever applied the last step holds the final state: no new group is awaited
            if status.phase is JobPhase.RECOVERING and not self.restart_tier:
                self.actions.append(Recovered(plan))  # it trained to the end unseen: over
            if self.restart_tier:  # the script's steps are not seen
                self.phase(
                    JobPhase.SUCCEEDED,
                    f"finished: every worker of generation {plan.generation} exited 0",
                )
            else:  # a save left uploading at the end: what lasts is named
                saved = w.checkpoint.step if w.checkpoint is not None else None
                self.phase(
                    JobPhase.SUCCEEDED, f"finished at step {status.step}{unsaved(status, saved)}"
                )
            return
        if any(r.unequal_sites for r in w.reports.values()):
            self.balance(plan)
            return
        if w.reports:
            # A member whose agent is gone did not raise anything: its peers' errors
            # came from the collectives it left (one the runtime could not see).
            node_gone = w.agents_gone & silent_members(plan, w.reports)
            if self.restart_tier and self.wait_for_reports(plan):
                return
            if any(r.user_error for r in w.reports.values()) and not node_gone:
                self.user_error(plan)
            else:
                self.handle_break(plan)
            return
        if (lost := breaks.gone_unreported(plan, w, self.in_grace())) is not None:
            self.replace(plan, lost)
            return
        if self.in_grace():
            return  # registrations and heartbeats are still coming back
        kills = hung_workers(self.spec, plan, self.w, self.m.hangs)
        if kills:
            before = self.m.hung[1] if self.m.hung[0] == plan.generation else frozenset()
            self.m.hung = (plan.generation, before | {k.node for k in kills})
        self.actions += kills
        recovering = status.phase is JobPhase.RECOVERING or (
            status.phase is JobPhase.PAUSED and self.m.paused_from is JobPhase.RECOVERING
        )
        if recovering and trains_again(plan, w, self.restart_tier, self.m.recovery_step):
            self.actions.append(Recovered(plan))  # its event says how long it took
            message = f"generation {plan.generation} trains again"
            if self.restart_tier:
                message = (
                    f"generation {plan.generation}: every worker restarted (restart "
                    f"{plan.generation - 1}); the script resumes from its own checkpoint"
                )
            if status.phase is JobPhase.PAUSED:
                self.m.paused_from = JobPhase.RUNNING  # the pause ends in Running
                status.message = message
            else:
                self.phase(JobPhase.RUNNING, message)
            self.m.recovery_started = None
        elif status.phase is JobPhase.RUNNING and not (
            self.restart_tier or kills or self.control.stop or w.done
        ):  # not while a stop or the end is under way: a joining worker would hold it up
            self.scale_up(plan)

    def scale_up(self, plan: Plan) -> None:
        """A generation below ``nodes.max`` takes in the warm nodes that joined since (a
        node back after a failure, one late for the start), as torchrun's rendezvous
        admits nodes that join; the in-process tier only (the restart tier would restart
        every worker from the script's checkpoint)."""
        added = plans.joining(self.spec, self.w, plan, self.m.dropped, self.restart_tier)
        if not added:
            return
        members = [m.node for m in plan.members]
        order = topology_ordered(self.spec, self.w, members + added, previous=members)
        spares = self.warm_nodes(but=set(order))
        if self.m.equal_sites:  # a site that would outgrow the others waits
            order, left_out = balanced_order(self.spec, self.w, order)
            spares += left_out
        joined = [n for n in order if n not in members]
        if not joined or not set(members) <= set(order):
            return  # a balance that would leave a member out is not a scale-up
        for node in joined:
            self.m.dropped.pop(node, None)
        why = f"scaled up to {len(order)} nodes: {', '.join(joined)} joined"
        self.status.spare_nodes = spares
        self.actions.append(Emit("ScaledUp", why, {"nodes": joined}))
        self.actions.append(PublishPlan(self.make_plan(plan.generation + 1, order, spares, why)))
        self.m.recovery_started = self.w.mono
        self.m.recovery_step = self.status.step
        self.phase(JobPhase.RECOVERING, f"generation {plan.generation + 1}: {why}")

    def wait_for_reports(self, plan: Plan) -> bool:
        """Restart tier: give silent members, not known dead, time to report first."""
        if self.m.reported is None or self.m.reported[0] != plan.generation:
            self.m.reported = (plan.generation, self.w.mono)
        return breaks.reports_pending(plan, self.w, self.m.reported[1])

    def user_error(self, plan: Plan) -> None:
        """The training script raised in a step: restart up to max_restarts, then fail."""
        if plan.generation not in self.m.user_errors:
            self.m.user_errors.append(plan.generation)
        worker, report = breaks.culprit(self.w.reports)
        if report.fault:  # the job's checkpoints: a restart would meet the same fault
            self.phase(JobPhase.FAILED, f"worker {worker}: {report.reason}", fault=report.fault)
            return
        limit = self.spec.fault_tolerance.max_restarts
        used = len(self.m.user_errors)
        gen = f"in generation {plan.generation}"  # the restart tier sees no steps
        where = gen if self.restart_tier else f"at step {report.step}"
        if used > limit:
            self.phase(
                JobPhase.FAILED,
                f"worker {worker} failed {where}: {report.reason} (an error in "
                f"the training script, {used} time(s), fault_tolerance.max_restarts is "
                f"{limit}); see `ringmaster logs {self.status.name}`",
                worker=worker,
            )
            return
        order = [m.node for m in plan.members]
        why = (
            f"restart {used} of {limit} after an error in the training script on {worker} "
            f"{where}: {report.reason}"
        )
        spares = [n for n in self.w.nodes if n not in order and self.warm(n)]
        self.actions.append(Emit("Restart", why, {"worker": worker, "step": report.step}))
        restarted = self.make_plan(plan.generation + 1, order, spares, "restart")
        self.actions.append(PublishPlan(restarted))
        self.status.message = why

    def handle_break(self, plan: Plan) -> None:
        w, m = self.w, self.m
        if m.break_generation != plan.generation:
            m.break_generation, m.break_seen_at = plan.generation, w.mono
            first = next(iter(w.reports.values()))
            if m.recovery_started is None:
                m.recovery_started = w.mono
            m.recovery_step = first.step
            if not all(r.planned for r in w.reports.values()):
                self.actions.append(FailureSeen(dict(w.reports), m.recovery_step))
                if self.restart_tier:  # the phase names the failed node, after the verdict
                    self.status.message = f"generation {plan.generation} broke"
                else:
                    self.phase(
                        JobPhase.RECOVERING, f"generation {plan.generation} broke: {first.reason}"
                    )
        hung = m.hung[1] if m.hung[0] == plan.generation else frozenset()
        verdict = breaks.judge_break(plan, w, hung, m.break_seen_at, self.in_grace())
        if verdict is not None:
            self.replace(plan, verdict)

    def balance(self, plan: Plan) -> None:
        """Workers found sites of different sizes for a model sharded in each site."""
        self.m.equal_sites = True
        members = [m.node for m in plan.members]
        there = [n for n in members if n in self.w.nodes and n not in self.w.agents_gone]
        order, left_out = balanced_order(self.spec, self.w, there)
        reason = next(r.reason for r in self.w.reports.values() if r.unequal_sites)
        if order == members or len(order) < self.spec.nodes.min:
            self.phase(JobPhase.FAILED, reason)  # no size fits: the workers said why
            return
        spares = [n for n in self.w.nodes if n not in members and self.warm(n)] + left_out
        why = "sites of one size for a model sharded in each site"
        why += f": {', '.join(left_out)} wait" if left_out else ""
        self.actions.append(Emit("SitesBalanced", why, {"left_out": left_out}))
        self.status.spare_nodes = spares
        self.actions.append(PublishPlan(self.make_plan(plan.generation + 1, order, spares, why)))
        self.phase(JobPhase.RECOVERING, f"generation {plan.generation + 1}: {why}")

    def replace(self, plan: Plan, verdict: breaks.Verdict) -> None:
        failed, why = verdict.failed, verdict.why
        members = [m.node for m in plan.members]
        spares = self.warm_nodes(but=set(members) | set(failed))
        order, swapped, spares = swap_in_spares(self.spec, self.w, plan, failed, spares)
        if self.restart_tier:  # a spare may have no checkpoint to broadcast from
            order = survivor_first(order, members, failed)
        if self.m.equal_sites:
            order, left_out = balanced_order(self.spec, self.w, order)
            spares += left_out
        kept = order
        if len(kept) < self.spec.nodes.min:
            if self.short_too_long(
                f"{why}; only {len(kept)} of the {self.spec.nodes.min} nodes needed were left",
                f"add nodes and `ringmaster resume {self.status.name}`",
            ):
                return
            self.phase(
                JobPhase.RECOVERING,
                f"{why}; {len(kept)} nodes left, need {self.spec.nodes.min}: waiting up to "
                f"{self.spec.rendezvous.join_timeout.total_seconds():g}s "
                "(rendezvous.join_timeout) for more",
            )
            return
        waited, spare_wait_s = plans.end_wait(self.m, self.w, members, order)  # it is over
        for node in failed:  # back in a generation only once registered again
            info = self.w.nodes.get(node)
            self.m.dropped[node] = info.started if info is not None else None
        for node in sorted(failed):
            if node not in self.status.failed_nodes:
                self.status.failed_nodes.append(node)
        if self.m.recovery_started is None:
            self.m.recovery_started = self.w.mono
            self.m.recovery_step = self.status.step
        self.status.recoveries += 1
        if swapped:
            reason = "; ".join(swapped) + waited
        elif failed:
            reason = f"scaled down to {len(kept)} nodes" + waited
        else:
            reason = "the same nodes again: " + why
        # the failed nodes' last heartbeats still look fresh for a moment: not spares
        self.status.spare_nodes = [n for n in spares if n not in failed]
        new_plan = self.make_plan(plan.generation + 1, order, spares, reason)
        # the plan first: every worker waits for it; what the failure was is recorded after
        self.actions.append(PublishPlan(new_plan))
        gone, step, seen = frozenset(verdict.agent_gone), self.status.step, verdict.seen_at
        self.actions.append(DeclareFailed(frozenset(failed), why, step, gone, seen, spare_wait_s))
        after = breaks.consequences(why, self.w.reports, failed) if self.restart_tier else ""
        self.phase(JobPhase.RECOVERING, f"generation {new_plan.generation}: {reason}{after}")
