"""Follow the job's plan and control keys, so the training loop never waits on etcd.

The controller publishes who trains (:class:`~orchestrator.state.records.Plan`,
one generation after another) and what the workers should do at the next
step boundary (:class:`~orchestrator.state.records.ControlRecord`).  A
:class:`PlanWatcher` keeps the newest of each in memory, from background
threads that follow both keys (:class:`~orchestrator.etcd.watch.KeyFollower`:
a watch broken by etcd going away resumes from the revision after the last
one seen, so no change is missed), until :meth:`PlanWatcher.stop`.

A worker started by a node agent reads both from the agent's plan feed
(:mod:`agents.channels.plan_feed`) instead, and watches etcd only once that feed ends.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from agents.channels.plan_feed import PLAN, follow_feed
from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.kv import WatchEvent
from orchestrator.etcd.watch import KeyFollower
from orchestrator.state import keys, records
from orchestrator.state.api import RecordError
from orchestrator.state.records import ControlRecord, Plan

log = logging.getLogger("ringmaster.worker")

#: A worker fed by its agent that waits for a newer plan reads etcd at most this
#: often (a worker watching etcd itself reads it after every wait that found none).
FEED_REREAD_S = 10.0


class PlanWatcher:
    """The newest plan and control record of ``job``, kept current from watches.

    Args:
        client: this worker's etcd client (the first read, and the watches).
        job: the job.
        feed: the node agent's plan feed (:data:`agents.channels.plan_feed.ENV_PLAN_FEED`'s
            value); None or empty: watch etcd from the start.
    """

    def __init__(self, client: EtcdClient, job: str, feed: str | None = None) -> None:
        self._client = client
        self._job = job
        self._plan_key = keys.job_plan(job)
        self._control_key = keys.job_control(job)
        self._cond = threading.Condition()
        self._plan: Plan | None = None
        self._plan_revision = -1
        self._control = ControlRecord()
        self._control_revision = -1
        self._loaded_at = -math.inf
        self._stopped = threading.Event()
        self._followers: list[KeyFollower] = []
        #: where the plan comes from now: ``feed`` (the node agent's) or ``etcd``
        self.source = "feed" if feed else "etcd"
        self.load()
        if feed:
            threading.Thread(target=self._follow_feed, args=(feed,), daemon=True).start()
        else:
            self._watch_etcd()

    def _watch_etcd(self) -> None:
        self.source = "etcd"
        for key in (self._plan_key, self._control_key):
            follower = KeyFollower(self._client, key, self._changed, stop=self._stopped)
            self._followers.append(follower.start())

    def _follow_feed(self, address: str) -> None:
        """Take what the agent's feed sends; once it ends, watch etcd instead."""
        try:
            for kind, revision, value in follow_feed(address, self._stopped):
                with self._cond:
                    self._take(
                        self._plan_key if kind == PLAN else self._control_key, value, revision
                    )
                    self._cond.notify_all()
        except OSError as e:
            log.info("plan feed of the node agent not readable (%s): watching etcd", e)
        if not self._stopped.is_set():
            log.debug("plan feed of the node agent ended: watching etcd")
            self._watch_etcd()

    def load(self) -> None:
        """Read plan and control now.

        Raises:
            EtcdError: etcd did not answer.
        """
        self._loaded_at = time.monotonic()
        kv = self._client.get(self._plan_key)
        control = self._client.get(self._control_key)
        with self._cond:
            if kv is not None:
                self._take(self._plan_key, kv.value, kv.mod_revision)
            if control is not None:
                self._take(self._control_key, control.value, control.mod_revision)
            self._cond.notify_all()

    def _reread_due(self) -> bool:
        """Whether a wait that found nothing newer should read etcd: always when
        watching it; fed by the agent (which re-reads after an outage itself),
        at most every :data:`FEED_REREAD_S`, in case the agent's watch is stuck."""
        return self.source == "etcd" or time.monotonic() - self._loaded_at >= FEED_REREAD_S

    def _load(self) -> None:
        try:
            self.load()
        except EtcdError as e:
            log.debug("plan not re-read: %s", e)

    def _take(self, key: str, raw: bytes, revision: int) -> None:
        """Keep a stored plan or control record (called with the lock held)."""
        try:
            if key == self._plan_key:
                plan = records.decode(Plan, raw, key)
                if self._plan is None or plan.generation > self._plan.generation:
                    self._plan = plan
                    self._plan_revision = revision
            elif revision > self._control_revision:
                self._control = records.decode(ControlRecord, raw, key)
                self._control_revision = revision
        except RecordError as e:  # written by something else: keep what we had
            log.warning("ignoring %s", e)

    def _changed(self, event: WatchEvent) -> None:
        """A follower's event: keep what was stored (a deleted key changes nothing)."""
        if event.value is None:
            return
        with self._cond:
            self._take(event.key, event.value, event.mod_revision)
            self._cond.notify_all()

    def wait_newer(self, generation: int, timeout: float) -> Plan | None:
        """The current plan if newer than ``generation``, waiting up to ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._plan is not None and self._plan.generation > generation, timeout
            )
            plan = self._plan
        if (plan is None or plan.generation <= generation) and self._reread_due():
            self._load()  # in case a watch hangs on a connection that died silently
            plan = self._plan
        return plan if plan is not None and plan.generation > generation else None

    def latest_generation(self) -> int:
        with self._cond:
            return self._plan.generation if self._plan else 0

    def revision_of(self, generation: int) -> int:
        """``mod_revision`` of the plan of ``generation``; -1 when it is no longer current."""
        with self._cond:
            if self._plan is not None and self._plan.generation == generation:
                return self._plan_revision
            return -1

    def control(self) -> ControlRecord:
        with self._cond:
            return self._control

    def stop(self) -> None:
        self._stopped.set()
        for follower in list(self._followers):
            follower.stop()
