"""What a node agent follows in etcd: the controller's commands to it, and the plan.

Runs in the node agent.  :class:`NodeWatches` is one of
:class:`~agents.node.agent.NodeAgent`'s collaborators: threads, each a watch
renewed after etcd outages (one loop for all, :meth:`NodeWatches._follow`).
One hands the controller's commands to this node (``kill-worker`` for a hung
worker, naming its pid, and ``stop``) to a :class:`NodeCommands`; another
keeps the newest plan (which the restart tier acts on) and logs this node's
role (active in generation N, or spare) each time it changes.  In the
in-process tier the agent also passes the plan and the control record on to
its workers (:mod:`agents.channels.plan_feed`), from these watches and a third
one, of the control key.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Protocol

from agents.channels.plan_feed import CONTROL, PLAN, PlanFeed
from agents.node.descriptions import describe_role
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.watch import KeyFollower
from orchestrator.state import keys, records
from orchestrator.state.api import RecordError
from orchestrator.state.records import AgentCommand, Plan

__all__ = ["NodeCommands", "NodeWatches"]

log = logging.getLogger("ringmaster.agent")


class NodeCommands(Protocol):
    """Who carries out the controller's commands to a node (its agent)."""

    def kill_worker(self, local_rank: int, pid: int | None, reason: str) -> None:
        """SIGKILL worker ``local_rank`` (a hung one), unless ``pid`` names one since replaced."""

    def request_stop(self, reason: str) -> None:
        """Stop the workers and leave."""


class NodeWatches:
    """A node agent's watches of etcd (see the module docstring).

    Built alone (a benchmark's simulated node, a test) it has no commands to
    carry out and only keeps and passes the plan on.

    Args:
        client: etcd.
        job / node: whose plan and commands.
        feed: passes the plan and the control record on to the workers (the
            in-process tier), or None.
        stop: ends every watch when set (the agent's own); a new one when None.
        commands: carries out the controller's commands (:meth:`watch_commands`).
    """

    def __init__(
        self,
        client: EtcdClient,
        job: str,
        node: str,
        feed: PlanFeed | None = None,
        *,
        stop: threading.Event | None = None,
        commands: NodeCommands | None = None,
    ) -> None:
        self.client = client
        self.job = job
        self.node = keys.segment(node, "node name")
        self._stop = stop if stop is not None else threading.Event()
        self._commands = commands
        self._generation = 0
        self._role: str | None = None
        #: the newest plan read (what the restart tier's supervision acts on)
        self._latest_plan: Plan | None = None
        self._feed = feed

    @property
    def latest_plan(self) -> Plan | None:
        """The newest plan read so far (None before the first)."""
        return self._latest_plan

    def request_stop(self, reason: str = "interrupted") -> None:
        """Stop watching (the threads end at their next event or retry)."""
        self._stop.set()

    def watch_plan(self) -> None:
        """Follow the plan (and, with a feed, the control key), each in a daemon thread."""
        for target, name in ((self._follow_plan, "plan"), (self._follow_control, "control")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def watch_commands(self) -> None:
        """Carry out the controller's commands to this node as they come (a daemon thread)."""
        threading.Thread(target=self._follow_commands, name="commands", daemon=True).start()

    def _follow_commands(self) -> None:
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
        """The watch loop: ``handle(key, value, mod_revision)`` for what is stored at
        ``key`` (or under it) now and for every later write, until stopped.  Every
        watch of the agent runs here, on :class:`~orchestrator.etcd.watch.KeyFollower`:
        after an etcd outage it resumes from the revision after the last one handled
        (deletions, such as a command taken, are not handed on)."""
        follower = KeyFollower(
            self.client,
            key,
            lambda ev: None if ev.value is None else handle(ev.key, ev.value, ev.mod_revision),
            prefix=prefix,
            stop=self._stop,
        )
        follower.run()

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
        commands = self._commands
        if commands is None:
            log.warning("[%s] no one to carry out command %r", self.node, name)
        elif name == "kill-worker":
            commands.kill_worker(cmd.local_rank, cmd.pid, cmd.reason)
        elif name == "stop":
            commands.request_stop(f"stopped by the controller ({cmd.reason or 'stop command'})")
        else:
            log.warning("[%s] unknown command %r", self.node, name)
