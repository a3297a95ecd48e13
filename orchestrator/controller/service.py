"""The controller: decides who trains, notices failures, publishes generations.

One leader (:mod:`orchestrator.etcd.leader`) runs a :class:`JobController` per
job.  Everything it knows lives in etcd, so a standby that takes over simply
reads it back.  Per job it:

* starts the job when ``nodes.max`` nodes registered (or ``nodes.min`` after
  the last-call timeout), taking the first ones in topology order as active
  and the rest as warm spares;
* detects failures: workers report a broken generation the moment a
  collective fails; a member node none of whose workers reported is probed
  on its agent's liveness port (:mod:`orchestrator.liveness`): refused means
  dead at once (SIGKILL), otherwise it is dead when it stays silent for
  ``REPORT_GRACE`` (power loss, cut link); a member whose registration
  lease expired is dead; a worker whose heartbeat thread stopped while its
  step stalled for ``hang_timeout`` is hung and gets killed by its agent;
* publishes the next generation with a warm spare in each dead node's slot
  (same ranks, so the ring order is kept), or scales down to ``nodes.min``
  when no spare is left;
* rides out etcd outages: when etcd did not answer it for longer than
  :data:`~orchestrator.etcd.client.SILENCE_THRESHOLD` (no quorum, a stall,
  leadership lapsed meanwhile), it marks the job
  ``Paused`` with the reason and, for ``OUTAGE_GRACE`` after etcd is back,
  declares no failure from lease expiry, stale heartbeats or missing
  reports (the agents re-register, the workers resume by themselves); a
  generation that every member reports broken is still replaced at once;
* relays checkpoint and stop requests to the workers (the ``control`` key,
  agreed on by all ranks at the same step), and records phase and events;
* observes: rate, history, recovery timings, effective training time and,
  with ``metrics_port``, Prometheus metrics (:mod:`orchestrator.observe.job_observer`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from orchestrator import events, keys
from orchestrator.api import EtcdError, JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.leader import LeaderElection
from orchestrator.jobs import read_spec, read_status
from orchestrator.liveness import Liveness, probe
from orchestrator.observe.job_observer import JobObserver
from orchestrator.observe.metrics import JobMetrics, MetricsServer
from orchestrator.records import JobStatus, Member, Plan

log = logging.getLogger("ringmaster.controller")

#: After the first failure report, how long to wait for the other survivors' reports.
REPORT_GRACE = timedelta(seconds=1.0)
#: A worker whose heartbeat is older than this many intervals is frozen or gone.
STALE_BEATS = 3
#: Controller loop period when nothing wakes it.
TICK = timedelta(seconds=0.2)
#: After an outage, how long lease expiry and stale heartbeats are not taken as failures
#: (agents re-register and workers beat again within a lease TTL or two).
OUTAGE_GRACE = timedelta(seconds=float(os.environ.get("RINGMASTER_OUTAGE_GRACE", "6")))


@dataclass
class _Break:
    generation: int
    seen_at: float
    steps: dict[str, int] = field(default_factory=dict)
    #: silent nodes whose liveness port refused the connection: dead, no need to wait
    confirmed_dead: set[str] = field(default_factory=set)
    probed: set[str] = field(default_factory=set)


class JobController:
    """Reconciles one job; :meth:`tick` is called whenever something may have changed."""

    def __init__(self, client: EtcdClient, job: str, metrics: JobMetrics | None = None) -> None:
        self.client = client
        self.job = job
        self.spec, self.spec_hash = read_spec(client, job)
        self.status = read_status(client, job) or JobStatus(job)
        self.observer = JobObserver(client, job, self.spec.fault_tolerance.hang_timeout, metrics)
        self._min_reached_at: float | None = None
        self._break: _Break | None = None
        self._recovery_started: float | None = None
        self._recovery_step = 0
        self._short_since: float | None = None  # fewer than nodes.min nodes left since then
        self._killed: dict[str, float] = {}
        self._last_written: dict[str, Any] = {}
        self._grace_until = 0.0
        self._paused_from: JobPhase | None = None
        self._silence_seen = client.last_silence

    # -- etcd outages ------------------------------------------------------------------

    def after_outage(self, seconds: float, reason: str) -> None:
        """The controller could not act for ``seconds``: pause, and hold fire for a grace."""
        self._grace_until = time.monotonic() + OUTAGE_GRACE.total_seconds()
        self._break = None  # report timing from before the outage means nothing now
        phase = self.status.phase
        if phase.terminal or phase is JobPhase.PENDING:
            return
        if phase is not JobPhase.PAUSED:
            self._paused_from = phase
        self._set_phase(
            JobPhase.PAUSED,
            f"paused: {reason} for {seconds:.1f}s; workers hold their state at a step boundary. "
            f"No failures are declared for {OUTAGE_GRACE.total_seconds():g}s while nodes "
            "re-register",
            outage_s=round(seconds, 2),
        )

    def _notice_outage(self) -> None:
        """Pause if etcd was silent since the last look (checked after each tick's reads)."""
        silence = self.client.last_silence
        if silence is not None and silence != self._silence_seen:
            self._silence_seen = silence
            log.warning("[%s] etcd did not answer for %.1fs", self.job, silence[1])
            self.after_outage(
                silence[1], "etcd was unavailable (no quorum, unreachable or stalled)"
            )

    def _in_grace(self) -> bool:
        return time.monotonic() < self._grace_until

    def _end_pause(self) -> None:
        if self.status.phase is JobPhase.PAUSED and not self._in_grace():
            back = self._paused_from or JobPhase.RUNNING
            self._paused_from = None
            self._set_phase(back, "resumed after the etcd outage")

    # -- reading the world -------------------------------------------------------------

    def _nodes(self) -> dict[str, dict[str, Any]]:
        out = {}
        for kv in self.client.get_prefix(keys.job_nodes(self.job)):
            out[kv.key.rsplit("/", 1)[1]] = json.loads(kv.value)
        return out

    def _progress(self) -> dict[str, dict[str, Any]]:
        out = {}
        for kv in self.client.get_prefix(keys.job_progress(self.job)):
            out[kv.key.rsplit("/", 1)[1]] = json.loads(kv.value)
        return out

    def _plan(self) -> Plan | None:
        data = self.client.get_json(keys.job_plan(self.job))
        return Plan.from_dict(data) if data else None

    def _workers(self, member: Member) -> list[str]:
        return [keys.worker_id(member.node, i) for i in range(member.nproc)]

    def _warm(self, node: str, info: dict[str, Any], progress: dict[str, Any]) -> bool:
        """A node whose every worker is alive and beating (ready to take a slot)."""
        interval = self.spec.fault_tolerance.heartbeat_interval.total_seconds()
        now = time.time()
        for i in range(int(info.get("slots", self.spec.nproc_per_node))):
            p = progress.get(keys.worker_id(node, i))
            if p is None or now - float(p.get("beat", 0)) > STALE_BEATS * interval:
                return False
            pids = info.get("worker_pids")
            if p.get("pid") is not None and pids is not None and p["pid"] not in pids:
                return False
        return True

    # -- the loop body -----------------------------------------------------------------

    def tick(self) -> None:
        if self.status.phase.terminal:
            return
        self._handle_commands()
        if self.status.phase.terminal:
            return
        nodes = self._nodes()
        progress = self._progress()
        plan = self._plan()
        if plan is None:
            self._maybe_start(nodes, progress)
        else:
            self._notice_outage()
            self._end_pause()
            self._watch_running(plan, nodes, progress)
        self.observer.observe(self.status, self._plan(), nodes, progress)
        self._write_status()

    def _maybe_start(self, nodes: dict[str, dict[str, Any]], progress: dict[str, Any]) -> None:
        warm = [n for n, info in nodes.items() if self._warm(n, info, progress)]
        need_max, need_min = self.spec.nodes.max, self.spec.nodes.min
        now = time.monotonic()
        if len(warm) >= need_min and self._min_reached_at is None:
            self._min_reached_at = now
        last_call = self.spec.rendezvous.last_call_timeout.total_seconds()
        ready = len(warm) >= need_max or (
            len(warm) >= need_min
            and self._min_reached_at is not None
            and now - self._min_reached_at >= last_call
        )
        self.status.message = f"waiting for nodes: {len(warm)} ready, need {need_min}..{need_max}"
        if not ready:
            self._fail_when_short_too_long(
                f"only {len(warm)} of the {need_min} nodes needed were ready",
                f"see `ringmaster logs {self.job}` and `ringmaster events` for why nodes "
                "did not come up",
            )
            return
        self._short_since = None
        ordered = _topology_order(warm, nodes, self.spec.comm.topology_labels)
        active = ordered[:need_max]
        plan = self._make_plan(1, active, nodes, ordered[need_max:], "start")
        self._publish(plan)
        self._set_phase(JobPhase.RUNNING, f"started with {len(active)} nodes: {', '.join(active)}")

    def _watch_running(
        self, plan: Plan, nodes: dict[str, dict[str, Any]], progress: dict[str, dict[str, Any]]
    ) -> None:
        members = {m.node: m for m in plan.members}
        workers = [w for m in plan.members for w in self._workers(m)]
        self.status.generation = plan.generation
        self.status.world_size = plan.world_size
        self.status.active_nodes = [m.node for m in plan.members]
        self.status.spare_nodes = [
            n for n, info in nodes.items() if n not in members and self._warm(n, info, progress)
        ]
        record = self.client.get_json(keys.job_checkpoint(self.job))
        if record and record.get("at") != self.status.last_checkpoint_at:
            self.status.last_checkpoint = f"step {record['step']} ({record['reason']})"
            self.status.last_checkpoint_at = float(record["at"])
            events.emit(
                self.client,
                self.job,
                "Checkpoint",
                f"step {record['step']} committed to {record['url']} ({record['reason']})",
                step=record["step"],
                **self.observer.checkpoint(progress),
            )
        steps = [int(progress[w]["step"]) for w in workers if w in progress]
        if steps:
            self.status.step = max(self.status.step, max(steps))

        done_records = {
            kv.key.rsplit("/", 1)[1]: json.loads(kv.value)
            for kv in self.client.get_prefix(keys.job_done(self.job))
        }
        done = set(done_records)
        last = self.spec.max_steps
        finished_all = last > 0 and any(int(r["step"]) >= last for r in done_records.values())
        if (workers and all(w in done for w in workers)) or finished_all:
            # A worker that applied the last step holds the final state: a failure
            # of its peers after that loses nothing, so nobody waits for a new group.
            self._set_phase(JobPhase.SUCCEEDED, f"finished at step {self.status.step}")
            return
        if self.client.get_json(keys.job_control(self.job)) or {}:
            control = self.client.get_json(keys.job_control(self.job)) or {}
            if control.get("stop") and all(w in done for w in workers if w in progress):
                self._set_phase(JobPhase.STOPPED, "stopped on request")
                return

        reports = {
            kv.key.rsplit("/", 1)[1]: json.loads(kv.value)
            for kv in self.client.get_prefix(keys.job_reports(self.job, plan.generation))
        }
        if reports:
            self._handle_break(plan, nodes, progress, reports)
            return
        if self._in_grace():
            return  # registrations and heartbeats are still coming back
        gone = [n for n in members if n not in nodes]
        if gone:
            self._replace(plan, nodes, progress, set(gone), f"lease expired: {', '.join(gone)}")
            return
        self._detect_hangs(plan, nodes, progress)
        recovering = self.status.phase is JobPhase.RECOVERING or (
            self.status.phase is JobPhase.PAUSED and self._paused_from is JobPhase.RECOVERING
        )
        if recovering and self._recovered(plan, workers, progress):
            took = time.monotonic() - (self._recovery_started or time.monotonic())
            self.observer.recovered(self.status, plan, progress)
            message = f"generation {plan.generation} trains again ({took:.2f}s after the failure)"
            if self.status.phase is JobPhase.PAUSED:
                self._paused_from = JobPhase.RUNNING  # the pause ends in Running
                self.status.message = message
            else:
                self._set_phase(JobPhase.RUNNING, message, recovery_s=round(took, 3))
            self._recovery_started = None

    def _recovered(self, plan: Plan, workers: list[str], progress: dict[str, Any]) -> bool:
        for w in workers:
            p = progress.get(w)
            if p is None or p.get("generation") != plan.generation:
                return False
            if int(p.get("step", 0)) <= self._recovery_step:
                return False
        return True

    def _handle_break(
        self,
        plan: Plan,
        nodes: dict[str, dict[str, Any]],
        progress: dict[str, Any],
        reports: dict[str, Any],
    ) -> None:
        now = time.monotonic()
        if self._break is None or self._break.generation != plan.generation:
            self._break = _Break(plan.generation, now)
            first = next(iter(reports.values()))
            if self._recovery_started is None:
                self._recovery_started = now
            self._recovery_step = int(first.get("step", 0))
            if not all(r.get("planned") for r in reports.values()):
                self.observer.failure_seen(reports, self._recovery_step)
                self._set_phase(
                    JobPhase.RECOVERING,
                    f"generation {plan.generation} broke: {first.get('reason', '')}",
                )
        silent = {m.node for m in plan.members if not all(w in reports for w in self._workers(m))}
        self._probe_silent(silent - self._break.probed, nodes)
        # a refused liveness probe is first-hand: it needs no grace, not even after an outage
        waiting = silent - self._break.confirmed_dead
        if waiting and (
            now - self._break.seen_at < REPORT_GRACE.total_seconds() or self._in_grace()
        ):
            return  # give the other survivors time to report
        if all(r.get("planned") for r in reports.values()) and not silent:
            return  # a planned switch: the new generation is already published
        dead = self._break.confirmed_dead & silent
        why = (
            f"agent of {', '.join(sorted(dead))} gone (liveness port refused)"
            if dead == silent
            else f"no report from {', '.join(sorted(silent))}"
        )
        self._replace(plan, nodes, progress, silent, why, agent_gone=dead)

    def _fail_when_short_too_long(self, what: str, advice: str) -> bool:
        """Fewer nodes than ``nodes.min``: fail the job once that lasted ``join_timeout``."""
        now = time.monotonic()
        self._short_since = self._short_since or now
        limit = self.spec.rendezvous.join_timeout.total_seconds()
        if now - self._short_since <= limit:
            return False
        self._set_phase(
            JobPhase.FAILED, f"{what} for {limit:g}s (rendezvous.join_timeout); {advice}"
        )
        return True

    def _probe_silent(self, silent: set[str], nodes: dict[str, dict[str, Any]]) -> None:
        """Ask each silent node's agent whether it is there; a refusal means dead now."""
        assert self._break is not None
        for node in sorted(silent):
            self._break.probed.add(node)
            address = (nodes.get(node) or {}).get("liveness")
            if not address:
                continue
            verdict, _ = probe(address)
            log.info("[%s] liveness of %s: %s", self.job, node, verdict.value)
            if verdict is Liveness.DEAD:
                self._break.confirmed_dead.add(node)

    def _replace(
        self,
        plan: Plan,
        nodes: dict[str, dict[str, Any]],
        progress: dict[str, Any],
        failed: set[str],
        why: str,
        agent_gone: set[str] | None = None,
    ) -> None:
        members = [m.node for m in plan.members]
        spares = [
            n
            for n in _topology_order(list(nodes), nodes, self.spec.comm.topology_labels)
            if n not in members and n not in failed and self._warm(n, nodes[n], progress)
        ]
        new_members: list[str] = []
        swapped: list[str] = []
        for node in members:
            if node not in failed:
                new_members.append(node)
            elif spares:
                spare = spares.pop(0)
                new_members.append(spare)
                swapped.append(f"{spare} replaces {node}")
        if len(new_members) < self.spec.nodes.min:
            if self._fail_when_short_too_long(
                f"{why}; only {len(new_members)} of the {self.spec.nodes.min} nodes needed were "
                "left",
                f"add nodes and `ringmaster resume {self.job}`",
            ):
                return
            self.status.message = (
                f"{why}; {len(new_members)} nodes left, need {self.spec.nodes.min}: waiting "
                f"up to {self.spec.rendezvous.join_timeout.total_seconds():g}s "
                "(rendezvous.join_timeout) for more"
            )
            self._set_phase(JobPhase.RECOVERING, self.status.message)
            return
        self._short_since = None
        cause = self.observer.declared(failed, why, nodes, self.status.step, agent_gone)
        for node in failed:
            if node not in self.status.failed_nodes:
                self.status.failed_nodes.append(node)
            events.emit(
                self.client,
                self.job,
                "NodeFailed",
                f"{node}: {why} ({cause})",
                node=node,
                cause=cause,
            )
        if self._recovery_started is None:
            self._recovery_started = time.monotonic()
            self._recovery_step = self.status.step
        self.status.recoveries += 1
        reason = "; ".join(swapped) or f"scaled down to {len(new_members)} nodes"
        new_plan = self._make_plan(plan.generation + 1, new_members, nodes, spares, reason)
        self._publish(new_plan)
        self._set_phase(JobPhase.RECOVERING, f"generation {new_plan.generation}: {reason}")

    def _detect_hangs(
        self, plan: Plan, nodes: dict[str, dict[str, Any]], progress: dict[str, Any]
    ) -> None:
        ft = self.spec.fault_tolerance
        now = time.time()
        stale_after = STALE_BEATS * ft.heartbeat_interval.total_seconds()
        beats = [
            float(p.get("beat", now))
            for p in (progress.get(w) for m in plan.members for w in self._workers(m))
            if p is not None and p.get("generation") == plan.generation
        ]
        if len(beats) > 1 and all(now - b > stale_after for b in beats):
            # A hung worker blocks its peers' steps, not their heartbeats: when every
            # heartbeat stopped at once, it is their way to etcd that is stuck (the
            # workers pause for that), not every worker hanging together.
            return
        for m in plan.members:
            for i, w in enumerate(self._workers(m)):
                p = progress.get(w)
                if p is None or p.get("generation") != plan.generation:
                    continue
                frozen = now - float(p.get("beat", now)) > stale_after
                stalled = now - float(p.get("step_time", now)) > ft.hang_timeout.total_seconds()
                # the record names the process that stopped beating: a restarted
                # worker (a new pid) is never killed for its predecessor's silence
                victim = f"{w}/{p.get('pid')}"
                if frozen and stalled and now - self._killed.get(victim, 0) > stale_after:
                    self._killed[victim] = now
                    self.client.put_json(
                        keys.agent_commands(self.job, m.node) + f"{time.time_ns():020d}",
                        {
                            "command": "kill-worker",
                            "local_rank": i,
                            "pid": p.get("pid"),
                            "reason": "hang",
                        },
                    )
                    events.emit(
                        self.client,
                        self.job,
                        "WorkerHung",
                        f"{w}: no step for {now - float(p['step_time']):.1f}s and no heartbeat;"
                        " killing it",
                        worker=w,
                    )

    def _handle_commands(self) -> None:
        for kv in self.client.get_prefix(keys.job_commands(self.job)):
            cmd = json.loads(kv.value)
            self.client.delete(kv.key)
            control = self.client.get_json(keys.job_control(self.job)) or {}
            name = cmd.get("command")
            if name == "stop":
                control["stop"] = True
                if self._plan() is None:
                    self._set_phase(JobPhase.STOPPED, "stopped before it started")
            elif name == "checkpoint":
                control["checkpoint"] = int(control.get("checkpoint", 0)) + 1
            else:
                events.emit(self.client, self.job, "BadCommand", f"unknown command {name!r}")
                continue
            self.client.put_json(keys.job_control(self.job), control)
            events.emit(
                self.client,
                self.job,
                "Command",
                f"{name} requested" + (f" ({cmd['args']['reason']})" if cmd.get("args") else ""),
            )

    # -- writing -----------------------------------------------------------------------

    def _make_plan(
        self,
        generation: int,
        active: list[str],
        nodes: dict[str, dict[str, Any]],
        spares: list[str],
        reason: str,
    ) -> Plan:
        members = []
        base = 0
        for node in active:
            info = nodes.get(node, {})
            nproc = int(info.get("slots", self.spec.nproc_per_node))
            members.append(Member(node, base, nproc, dict(info.get("labels", {}))))
            base += nproc
        return Plan(generation, members, spares=list(spares), reason=reason)

    def _publish(self, plan: Plan) -> None:
        self.client.put_json(keys.job_plan(self.job), plan.to_dict())
        log.warning(
            "[%s] generation %d: %s (%s)",
            self.job,
            plan.generation,
            ", ".join(m.node for m in plan.members),
            plan.reason,
        )
        events.emit(
            self.client,
            self.job,
            "Generation",
            f"generation {plan.generation}: {', '.join(m.node for m in plan.members)} "
            f"({plan.reason})",
            generation=plan.generation,
        )

    def _set_phase(self, phase: JobPhase, message: str, **data: Any) -> None:
        self.status.message = message
        if phase is self.status.phase:
            return
        if not self.status.phase.can_move_to(phase):
            log.error("[%s] refusing %s -> %s", self.job, self.status.phase.value, phase.value)
            return
        self.status.phase = phase
        events.emit(self.client, self.job, "Phase", f"{phase.value}: {message}", **data)
        log.warning("[%s] %s: %s", self.job, phase.value, message)
        self._write_status()

    def _write_status(self) -> None:
        data = self.status.to_dict()
        comparable = {k: v for k, v in data.items() if k != "updated_at"}
        if comparable == self._last_written:
            return
        self._last_written = comparable
        data["updated_at"] = time.time()
        self.client.put_json(keys.job_status(self.job), data)


def _topology_order(
    nodes: list[str], info: dict[str, dict[str, Any]], labels: list[str]
) -> list[str]:
    """Sort nodes so that nodes sharing zone, then rack, then host are adjacent."""

    def key(node: str) -> tuple[str, ...]:
        node_labels = info.get(node, {}).get("labels", {})
        return (*(str(node_labels.get(label, "")) for label in labels), node)

    return sorted(nodes, key=key)


class Controller:
    """Leader-elected controller for one job (``job``) or for every job in etcd."""

    def __init__(
        self,
        client: EtcdClient,
        job: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        self.client = client
        self.job = job
        self.election = LeaderElection(client)
        self._jobs: dict[str, JobController] = {}
        self._wake = threading.Event()
        self.metrics = JobMetrics() if metrics_port is not None else None
        self.metrics_server = (
            MetricsServer(self.metrics.registry, metrics_host, metrics_port)
            if self.metrics is not None and metrics_port is not None
            else None
        )

    def run(self, stop: threading.Event, exit_when_done: bool = False) -> None:
        """Lead (after winning the election) until ``stop`` is set."""
        if not self.election.wait_for_leadership(stop):
            return
        if self.metrics_server is not None:
            url = self.metrics_server.start()
            self.client.put(keys.controller_metrics(), url)
        threading.Thread(target=self._follow, args=(stop,), daemon=True).start()
        try:
            while not stop.is_set():
                if not self.election.is_leader:
                    log.warning("leadership lost; campaigning again")
                    if not self.election.wait_for_leadership(stop):
                        return
                try:
                    self._tick_all()
                except EtcdError as e:
                    log.warning("etcd unavailable, retrying: %s", e)
                current = self._jobs.get(self.job) if self.job else None
                if exit_when_done and current is not None and current.status.phase.terminal:
                    return
                self._wake.wait(TICK.total_seconds())
                self._wake.clear()
        finally:
            self.election.resign()
            if self.metrics_server is not None:
                self.metrics_server.stop()

    def _follow(self, stop: threading.Event) -> None:
        """Wake the loop on any change under the jobs prefix; renew the watch after outages."""
        while not stop.is_set():
            watch: Any = None
            try:
                watch = self.client.watch(keys.jobs_prefix(), prefix=True)
                for _ in watch:
                    self._wake.set()
                    if stop.is_set():
                        break
            except Exception as e:  # etcd gone; the loop's timeout keeps us going
                log.debug("controller watch ended: %s", e)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        watch.cancel()
            stop.wait(0.5)

    def _tick_all(self) -> None:
        names = [self.job] if self.job else _job_names(self.client)
        for name in names:
            jc = self._jobs.get(name)
            if jc is None:
                if self.client.get(keys.job_spec(name)) is None:
                    continue
                jc = self._jobs[name] = JobController(self.client, name, self.metrics)
            jc.tick()


def _job_names(client: EtcdClient) -> list[str]:
    prefix = keys.jobs_prefix()
    return sorted({kv.key[len(prefix) :].split("/", 1)[0] for kv in client.get_prefix(prefix)})
