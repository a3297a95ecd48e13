"""Follow the job's plan and control keys, so the training loop never waits on etcd.

The controller publishes who trains (:class:`~orchestrator.records.Plan`,
one generation after another) and what the workers should do at the next
step boundary (:class:`~orchestrator.records.ControlRecord`).  A
:class:`PlanWatcher` keeps the newest of each in memory, from background
threads that watch both keys.  A watch ends when etcd goes away (a member
killed, quorum lost, the node cut off); each is re-established, after a
fresh read, until :meth:`PlanWatcher.stop`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from orchestrator import keys, records
from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.records import ControlRecord, Plan, RecordError

log = logging.getLogger("ringmaster.worker")


class PlanWatcher:
    """The newest plan and control record of ``job``, kept current from watches."""

    def __init__(self, client: EtcdClient, job: str) -> None:
        self._client = client
        self._job = job
        self._plan_key = keys.job_plan(job)
        self._control_key = keys.job_control(job)
        self._cond = threading.Condition()
        self._plan: Plan | None = None
        self._plan_revision = -1
        self._control = ControlRecord()
        self._stopped = threading.Event()
        self._watches: dict[str, Any] = {}
        self.load()
        for key in (self._plan_key, self._control_key):
            threading.Thread(target=self._follow, args=(key,), daemon=True).start()

    def load(self) -> None:
        """Read plan and control now.

        Raises:
            EtcdError: etcd did not answer.
        """
        kv = self._client.get(self._plan_key)
        control = self._client.get(self._control_key)
        with self._cond:
            if kv is not None:
                self._take(self._plan_key, kv.value, kv.mod_revision)
            if control is not None:
                self._take(self._control_key, control.value, control.mod_revision)
            self._cond.notify_all()

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
            else:
                self._control = records.decode(ControlRecord, raw, key)
        except RecordError as e:  # written by something else: keep what we had
            log.warning("ignoring %s", e)

    def _follow(self, key: str) -> None:
        while not self._stopped.is_set():
            try:
                watch = self._client.watch(key)
                self._watches[key] = watch
                if self._stopped.is_set():
                    watch.cancel()
                    return
                self._load()  # whatever changed while no watch was running
                for ev in watch:
                    if ev.value is None:
                        continue
                    with self._cond:
                        self._take(key, ev.value, ev.mod_revision)
                        self._cond.notify_all()
            except Exception as e:  # etcd went away; the loop watches again
                log.debug("watch of %s ended: %s", key, e)
            self._stopped.wait(0.5)

    def wait_newer(self, generation: int, timeout: float) -> Plan | None:
        """The current plan if newer than ``generation``, waiting up to ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._plan is not None and self._plan.generation > generation, timeout
            )
            plan = self._plan
        if plan is None or plan.generation <= generation:
            self._load()  # a watch may have missed an event while etcd was away
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
        for w in list(self._watches.values()):
            with contextlib.suppress(Exception):
                w.cancel()
