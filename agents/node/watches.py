"""What a node agent follows in etcd: the controller's commands to it, and the plan.

:class:`NodeWatches` is a part of :class:`~agents.node.agent.NodeAgent`: two
threads, each a watch renewed after etcd outages.  One executes the
controller's commands to this node (``kill-worker`` for a hung worker, naming
its pid, and ``stop``); the other logs this node's role (active in generation
N, or spare) each time it changes.  In the in-process tier the agent also
passes the plan and the control record on to its workers (:mod:`agents.channels.plan_feed`),
from these watches and a third one, of the control key.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agents.channels.plan_feed import CONTROL, PLAN, PlanFeed
from agents.node.descriptions import describe_role
from orchestrator import keys, records
from orchestrator.etcd.client import EtcdClient
from orchestrator.records import AgentCommand, Plan, RecordError

if TYPE_CHECKING:
    from agents.node.agent import _Worker

log = logging.getLogger("ringmaster.agent")


class NodeWatches:
    """The watching half of a node agent (see the module docstring).

    A :class:`~agents.node.agent.NodeAgent` is one; built alone (a benchmark's
    simulated node, a test), it has no workers and only passes the plan on.
    """

    def __init__(self, client: EtcdClient, job: str, node: str, feed: PlanFeed | None) -> None:
        self.client = client
        self.job = job
        self.node = keys.segment(node, "node name")
        self.workers: dict[int, _Worker] = {}
        self._stop = threading.Event()
        self._generation = 0
        self._role: str | None = None
        #: the newest plan read (what the restart tier's supervision acts on)
        self._latest_plan: Plan | None = None
        #: in-process tier: passes the plan and control record on (agents.channels.plan_feed)
        self._feed = feed

    def request_stop(self, reason: str = "interrupted") -> None:
        """Stop watching (a node agent also stops its workers and leaves)."""
        self._stop.set()

    def watch_plan(self) -> None:
        """Follow the plan (and, with a feed, the control key), each in a daemon thread."""
        for target, name in ((self._follow_plan, "plan"), (self._follow_control, "control")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def _follow_commands(self) -> None:
        """Execute the controller's commands to this node as they come."""
        self._follow(keys.agent_commands(self.job, self.node), True, self._take)

    def _follow_plan(self) -> None:
        """Log this node's role each time it changes (and keep the newest plan)."""
        self._follow(keys.job_plan(self.job), False, self._note_plan)

    def _follow_control(self) -> None:
        """Pass the control record on to the workers (only with a plan feed)."""
        feed = self._feed
        if feed is not None:
            self._follow(
                keys.job_control(self.job),
                False,
                lambda _, value, rev: feed.publish(CONTROL, value, rev),
            )

    def _follow(self, key: str, prefix: bool, handle: Callable[[str, bytes, int], object]) -> None:
        """``handle(key, value, mod_revision)`` for what is stored at ``key`` (or under
        it) now and for every later write, until stopped; the watch is renewed after
        etcd outages."""
        while not self._stop.is_set():
            watch: Any = None
            try:
                watch = self.client.watch(key, prefix=prefix)
                # what was written while no watch ran
                for kv in self.client.get_prefix(key) if prefix else [self.client.get(key)]:
                    if kv is not None:
                        handle(kv.key, kv.value, kv.mod_revision)
                for ev in watch:
                    if self._stop.is_set():
                        break
                    if ev.value is not None:
                        handle(ev.key, ev.value, ev.mod_revision)
            except Exception as e:  # etcd went away, or the watch was cancelled
                log.debug("watch of %s ended: %s", key, e)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        watch.cancel()
            self._stop.wait(0.5)

    def _note_plan(self, key: str, value: bytes, revision: int) -> None:
        if self._feed is not None:  # the workers judge it themselves, as read from etcd
            self._feed.publish(PLAN, value, revision)
        try:
            plan = records.decode(Plan, value, key)
        except RecordError as e:
            log.debug("plan not readable: %s", e)
            return
        if plan.generation < self._generation:
            return  # a watch event older than the plan already read
        self._generation = plan.generation
        self._latest_plan = plan  # what the restart tier's supervision acts on
        role, line = describe_role(plan, self.node)
        if role != self._role and not self._stop.is_set():
            self._role = role
            log.info("[%s] %s", self.node, line)

    def _take(self, key: str, value: bytes, revision: int) -> None:
        with contextlib.suppress(Exception):
            if not self.client.delete(key):
                return  # already executed
        try:
            cmd = records.decode(AgentCommand, value, key)
        except RecordError as e:
            log.warning("[%s] ignoring a command that cannot be read: %s", self.node, e)
            return
        self._execute(cmd)

    def _execute(self, cmd: AgentCommand) -> None:
        name = cmd.command
        if name == "kill-worker":
            w = self.workers.get(cmd.local_rank)
            pid = cmd.pid
            if w is not None and pid is not None and w.proc.pid != pid:
                log.warning(
                    "[%s] not killing worker %d: pid %s named by the command has already "
                    "been replaced by %d",
                    self.node,
                    w.local_rank,
                    pid,
                    w.proc.pid,
                )
            elif w is not None and w.proc.poll() is None:
                log.warning("[%s] killing worker %d (%s)", self.node, w.local_rank, cmd.reason)
                w.proc.kill()
        elif name == "stop":
            self.request_stop(f"stopped by the controller ({cmd.reason or 'stop command'})")
        else:
            log.warning("[%s] unknown command %r", self.node, name)
