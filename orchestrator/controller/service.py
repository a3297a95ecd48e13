"""The controller service: one leader, elected through an etcd lease, runs every job.

:class:`Controller` campaigns for leadership (:mod:`orchestrator.etcd.leader`),
then ticks a :class:`~orchestrator.controller.job.JobController` per job
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

from orchestrator import keys, records
from orchestrator.api import EtcdError
from orchestrator.controller.job import JobController
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.compactor import HistoryCompactor
from orchestrator.etcd.kv import WatchEvent
from orchestrator.etcd.leader import LeaderElection
from orchestrator.etcd.watch import KeyFollower
from orchestrator.observe.metrics import JobMetrics, MetricsServer
from orchestrator.records import SpecRecord

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
        self.election = LeaderElection(client, key=keys.controller_leader(job))
        self._jobs: dict[str, JobController] = {}
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
            self.election.resign()
            if self.metrics_server is not None:
                self.metrics_server.stop()

    def _changed(self, event: WatchEvent) -> None:
        """Wake the loop on a change under the jobs prefix that it must act on at once."""
        if wakes(event.key):
            self._wake.set()

    def _tick_all(self) -> None:
        names = [self.job] if self.job else _job_names(self.client)
        for name in names:
            record = records.read(self.client, keys.job_spec(name), SpecRecord)
            if record is None:
                gone = self._jobs.pop(name, None)  # gone, or between two runs
                if gone is not None:
                    gone.close()
                continue
            jc = self._jobs.get(name)
            if jc is None or jc.run != record.run:
                # a new run of the job (resubmitted or resumed): a fresh controller
                if jc is not None:
                    jc.close()
                jc = self._jobs[name] = JobController(self.client, name, self.metrics)
            jc.tick()


def wakes(key: str) -> bool:
    """Whether a change of ``key`` (under the jobs prefix) should tick the loop at once."""
    rest = key[len(keys.jobs_prefix()) :].split("/", 1)
    return len(rest) < 2 or not rest[1].startswith(NO_WAKE)


def _job_names(client: EtcdClient) -> list[str]:
    return [name for name in client.child_names(keys.jobs_prefix()) if name]
