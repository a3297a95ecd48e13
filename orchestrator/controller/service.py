"""The controller service: per job one leader, elected through an etcd lease, decides it.

:class:`Controller` campaigns for leadership (:mod:`orchestrator.controller.leader`).
Each job has one election key, whatever mix of controllers runs: a
controller started for one job (``--job``, as ``ringmaster run`` and the
operator start them) campaigns on it, and so does a controller of every job,
for each job it sees (:class:`~orchestrator.controller.leader.JobLeadership`), once
it leads the controllers of every job (one of them at a time compacts and
serves metrics; it lets go of its jobs when it loses that).  So one process
at a time decides a job, and a controller that lost a job and won it again
reads it back from etcd.  The leader ticks a
:class:`~orchestrator.controller.job.JobController` per job it leads
every ``TICK``, and at once when something it must act on changes under the
jobs prefix (a watch wakes it: registrations, reports, commands, the plan;
not the steady stream of progress, nor logs, history, events and status,
which the controller writes itself, see :data:`NO_WAKE`; the watch resumes
after etcd outages, :class:`~orchestrator.etcd.watch.KeyFollower`), and compacts etcd's
history every few seconds (:mod:`orchestrator.etcd.compactor`).  Standbys wait;
one that takes over reads everything back from etcd.  With ``metrics_port``
it serves Prometheus metrics and publishes their URL.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from orchestrator.api import EtcdError
from orchestrator.controller.job import JobController
from orchestrator.controller.leader import JobLeadership, LeaderElection
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.compactor import HistoryCompactor
from orchestrator.etcd.kv import WatchEvent
from orchestrator.etcd.watch import KeyFollower
from orchestrator.observe.metrics import JobMetrics, MetricsServer
from orchestrator.state import keys, records
from orchestrator.state.jobs import read_status
from orchestrator.state.records import SpecRecord

log = logging.getLogger("ringmaster.controller")

#: Controller loop period when nothing wakes it.
TICK = timedelta(seconds=0.2)
#: At exit, how long the controller waits for finished jobs' checkpoint roots to be released.
RELEASE_WAIT = timedelta(seconds=5)
#: What changes under a job that do not wake the loop (the next ``TICK`` reads them):
#: a thousand nodes write their progress every second, and the controller's own
#: writes would wake it again after every tick.
NO_WAKE = ("progress/", "node-progress/", "logs/", "history/", "events/", "status", "recoveries/")


class Controller:
    """Leader-elected controller for one job (``job``) or for every job in etcd.

    Attributes:
        election: the election of this kind of controller: the job's for a controller
            of one job, that of the controllers of every job otherwise.
        job_leadership: a controller of every job: its leadership of each job (None
            for a controller of one job, whose ``election`` is the job's).
    """

    def __init__(
        self,
        client: EtcdClient,
        job: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        self.client = client
        self.job = job
        self.job_leadership = JobLeadership(client) if job is None else None
        self.election = LeaderElection(
            client,
            key=keys.controller_leader(job),
            what=f"of job {job}" if job else "of the controllers of every job",
            on_lost=self.job_leadership.release_all if self.job_leadership else None,
        )
        self._jobs: dict[str, JobController] = {}
        #: the leadership term each job's controller was built in
        self._terms: dict[str, int] = {}
        #: a controller of every job: the run of each job seen ended (not campaigned for)
        self._ended: dict[str, int] = {}
        self._wake = threading.Event()
        self.metrics = JobMetrics() if metrics_port is not None else None
        if self.metrics is not None:
            self.metrics.watch_etcd(client)
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
            self.client.put(keys.controller_metrics(self.job), url)
        follower = KeyFollower(
            self.client,
            keys.jobs_prefix(),
            self._changed,
            prefix=True,
            values=False,  # the tick reads what it needs; a watch only wakes it
            on_read=self._wake.set,  # after a compaction: what changed is unknown
        )
        follower.start("controller-wake")
        compactor = HistoryCompactor(self.client)
        threading.Thread(
            target=compactor.run,
            args=(stop, lambda: self.election.is_leader),
            name="etcd-compactor",
            daemon=True,
        ).start()
        failing: type | None = None  # the kind of error of the failing ticks, logged once
        try:
            while not stop.is_set():
                if not self.election.is_leader:
                    log.warning("leadership lost; campaigning again")
                    if not self.election.wait_for_leadership(stop):
                        return
                try:
                    self._tick_all()
                except EtcdError as e:
                    if failing is not type(e):  # a tick every 0.2 s: say it once per kind
                        log.warning("etcd unavailable, retrying: %s", e)
                    failing = type(e)
                else:
                    if failing is not None:
                        log.info("etcd answers again")
                    failing = None
                current = self._jobs.get(self.job) if self.job else None
                if exit_when_done and current is not None and current.status.phase.terminal:
                    return
                self._wake.wait(TICK.total_seconds())
                self._wake.clear()
        finally:
            deadline = time.monotonic() + RELEASE_WAIT.total_seconds()
            for jc in self._jobs.values():
                jc.close(wait=max(deadline - time.monotonic(), 0.0))
            follower.stop()
            if self.job_leadership is not None:
                self.job_leadership.release_all()
            self.election.resign()
            if self.metrics_server is not None:
                self.metrics_server.stop()

    def _changed(self, event: WatchEvent) -> None:
        """Wake the loop on a change under the jobs prefix that it must act on at once."""
        if wakes(event.key):
            self._wake.set()

    def tick(self) -> None:
        """One round over the jobs this controller leads (campaigning for the others)."""
        self._tick_all()

    def _tick_all(self) -> None:
        names = [self.job] if self.job else _job_names(self.client)
        for name in names:
            record = records.read(self.client, keys.job_spec(name), SpecRecord)
            if record is None:
                self._forget(name)  # gone, or between two runs
                continue
            term = self._lead(name, record.run)
            if term is None:  # another controller decides it, or it ended, or etcd is away
                if self._ended.get(name) == record.run and (done := self._jobs.pop(name, None)):
                    done.close()
                continue
            jc = self._jobs.get(name)
            if jc is None or jc.run != record.run or self._terms.get(name) != term:
                # a new run of the job (resubmitted or resumed), or leadership lost and
                # won again (another may have decided meanwhile): read it back from etcd
                if jc is not None:
                    jc.close()
                jc = self._jobs[name] = JobController(
                    self.client, name, self.metrics, wake=self._wake.set
                )
                self._terms[name] = term
            elif jc.spec_hash != record.hash:  # changed in place (the operator's update)
                jc.take_spec()
            jc.tick()
            if self.job_leadership is not None and jc.status.phase.terminal:
                self._ended[name] = jc.run  # nothing left to decide: let go of its key
                self.job_leadership.release(name)
        if self.job_leadership is not None:
            for gone in set(self.job_leadership.jobs()) - set(names):
                self._forget(gone)

    def _lead(self, job: str, run: int) -> int | None:
        """The term in which this controller leads ``job`` now; None when it does not."""
        if self.job_leadership is None:
            return self.election.term if self.election.is_leader else None
        if self._ended.get(job) == run:
            return None
        return self.job_leadership.term(job, worth_it=lambda: not self._has_ended(job, run))

    def _has_ended(self, job: str, run: int) -> bool:
        """Whether ``run`` of ``job`` has ended (read before campaigning for it)."""
        status = read_status(self.client, job)
        if status is not None and status.run == run and status.phase.terminal:
            self._ended[job] = run
            return True
        return False

    def _forget(self, job: str) -> None:
        gone = self._jobs.pop(job, None)
        if gone is not None:
            gone.close()  # its hold of the checkpoint root
        self._terms.pop(job, None)
        self._ended.pop(job, None)
        if self.job_leadership is not None:
            self.job_leadership.release(job)


def wakes(key: str) -> bool:
    """Whether a change of ``key`` (under the jobs prefix) should tick the loop at once."""
    rest = key[len(keys.jobs_prefix()) :].split("/", 1)
    return len(rest) < 2 or not rest[1].startswith(NO_WAKE)


def _job_names(client: EtcdClient) -> list[str]:
    return [name for name in client.child_names(keys.jobs_prefix()) if name]
