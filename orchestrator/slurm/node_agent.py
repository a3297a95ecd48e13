"""One node of a Slurm allocation: the node agent, named and labelled by Slurm, watching
its node's state (``ringmaster slurm agent``, what each task of the agents' step runs).

Runs in the agent's process on each node.  The agent is the plain node agent
(:class:`~agents.node.agent.NodeAgent`) with what Slurm knows of the node:

* its name is the Slurm node's (``SLURMD_NODENAME``), its ``host`` label too;
  its other topology labels come from Slurm's switches
  (:func:`~orchestrator.slurm.scontrol_text.topology_labels`: the leaf switch is
  its ``rack``, the one above its ``zone``), where the cluster has a topology
  plugin;
* its address is the node's ``NodeAddr`` (``RINGMASTER_ADDRESS`` overrides it);
* a :class:`DrainWatch` reads the node's state (``scontrol show node``) every
  heartbeat interval.  A drained node (``scontrol update state=drain``, a
  reboot asked for) is a planned departure, told apart from a crash: the agent
  does what it does on a preemption notice (SIGTERM): the job saves, then the
  node leaves and a spare takes its slot, no step lost.  A crashed node is
  noticed as any lost node is (its lease, its liveness watch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Mapping
from datetime import timedelta

from agents.node.agent import NodeAgent
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.options import EtcdOptions
from orchestrator.slurm import commands
from orchestrator.slurm.api import NodeState, SlurmError
from orchestrator.state import events

__all__ = ["DrainWatch", "slurm_node_agent"]

log = logging.getLogger("ringmaster.agent")

#: How often the node's state is read before the job's heartbeat interval is known.
DEFAULT_POLL = timedelta(seconds=2)
#: The shortest interval between two reads of the node's state (slurmctld serves them all).
MIN_POLL = timedelta(milliseconds=500)


def slurm_node_agent(
    client: EtcdClient,
    options: EtcdOptions,
    job: str,
    env: Mapping[str, str] | None = None,
) -> tuple[NodeAgent, DrainWatch]:
    """The node agent of this Slurm node, and the watch that preempts it when the node
    is drained (start it, then run the agent).

    Falls back to the host name where ``SLURMD_NODENAME`` is not set.
    """
    env = os.environ if env is None else env
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    state: NodeState | None = None
    with contextlib.suppress(SlurmError):
        state = commands.node_state(node)
    labels = {**commands.node_labels(node), "host": node}
    address = env.get("RINGMASTER_ADDRESS") or _resolve(state.address if state else node)
    agent = NodeAgent(client, options, job, node, labels, address)
    return agent, DrainWatch(client, job, node, agent)


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


class DrainWatch:
    """Reads a node's Slurm state every heartbeat interval; on a drain, preempts the agent.

    One thread; :meth:`stop` ends it.  A failed read (slurmctld busy or away) is
    logged once and tried again at the next interval: it never stops the agent.
    """

    def __init__(self, client: EtcdClient, job: str, node: str, agent: NodeAgent) -> None:
        self.client = client
        self.job = job
        self.node = node
        self.agent = agent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slurm-drain", daemon=True)
        #: the state that made the agent leave (None: it has not)
        self.left_for: NodeState | None = None

    def start(self) -> DrainWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _interval(self) -> float:
        spec = self.agent.spec
        every = spec.fault_tolerance.heartbeat_interval if spec is not None else DEFAULT_POLL
        return max(every, MIN_POLL).total_seconds()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self._interval()):
            try:
                state = commands.node_state(self.node, timeout=timedelta(seconds=10))
            except SlurmError as e:
                if not failing:
                    log.warning("[%s] cannot read this node's Slurm state: %s", self.node, e)
                failing = True
                continue
            failing = False
            if state.leaving:
                self._leave(state)
                return

    def _leave(self, state: NodeState) -> None:
        self.left_for = state
        message = (
            f"{self.node} is {state.describe()} in Slurm: a planned departure; it leaves as "
            "on a preemption (the job saves, a spare takes its slot)"
        )
        log.warning("[%s] %s", self.node, message)
        with contextlib.suppress(Exception):
            if self.agent.spec is not None:  # else it has not joined the job: nothing to say
                events.emit(self.client, self.job, "NodeDraining", message, source=self.node)
        self.agent.preempt()
