"""What the node agent's parts give each other: the contracts of the node daemon.

Runs in the node agent.  A :class:`~agents.node.agent.NodeAgent` is composed
of collaborators, each told what it needs and nothing more:

* a *tier* (:class:`Tier`) runs the workers: the in-process tier
  (:mod:`agents.node.in_process_tier`) or the restart tier
  (:mod:`agents.node.restart_tier`).  It gets a :class:`TierSetup` (the job,
  where its files go, how a worker's environment is built, how to register
  the node again) and returns an :class:`Outcome` when the agent should leave;
* the watches (:mod:`agents.node.watches`) follow etcd; the restart tier reads
  the newest plan from them (:class:`PlanSource`), and they hand the
  controller's commands to a :class:`~agents.node.watches.NodeCommands`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agents.api import AgentError
from agents.node.log_shipper import LogShipper
from agents.node.worker_process import WorkerProcess
from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.spec.job import JobSpec
from orchestrator.state.jobs import read_status
from orchestrator.state.records import Plan

__all__ = ["JobNotSubmittedError", "NodeRefusedError", "Outcome", "PlanSource", "Tier", "TierSetup"]


class JobNotSubmittedError(AgentError):
    """No run of the job to join came within the agent's wait limit (a permanent error)."""


class NodeRefusedError(AgentError):
    """This node cannot run the job's workers as the job asks (a permanent error)."""


@dataclass(frozen=True)
class TierSetup:
    """What a tier needs from its agent.

    Attributes:
        client: etcd.
        job / node: whose workers these are.
        run: the run of the job the agent joined (a resubmit starts the next one).
        spec: the job's spec (its recovery resolved).
        workdir: where the workers start.
        errors_dir: where their torch elastic error files go.
        stop: set when the agent stops (a tier's loops end on it).
        worker_env: the environment of the worker in a local slot (either tier's
            base: the job's, the agent's sockets, ``WorkerEnv``).
        register: write the node's registration again (the worker pids changed).
    """

    client: EtcdClient
    job: str
    node: str
    run: int
    spec: JobSpec
    workdir: str
    errors_dir: Path
    stop: threading.Event
    worker_env: Callable[[int], dict[str, str]]
    register: Callable[[], None]

    def shipper(self, local_rank: int) -> LogShipper:
        """A reader of worker ``local_rank``'s output (to the agent's stdout and files)."""
        return LogShipper(self.client, self.job, self.node, local_rank, sys.stdout.buffer)

    def run_ended(self) -> Outcome | None:
        """Why the agent's run of the job is over (its phase is final, or a newer run
        replaced it); None while it goes on, or when its status cannot be read now."""
        try:
            status = read_status(self.client, self.job)
        except Exception:  # etcd away, or a record being replaced: not known to have ended
            return None
        if status is None:
            return None  # between two runs: the next read sees the new one
        if status.run != self.run:
            return Outcome(f"run {self.run} of the job is over (run {status.run} started)")
        if status.phase.terminal:
            failed = status.phase is JobPhase.FAILED
            return Outcome(f"job {status.phase.value}", exit_code=1 if failed else 0)
        return None


@dataclass(frozen=True)
class Outcome:
    """Why a tier's supervision ended: the agent leaves with it.

    Attributes:
        reason: logged as the agent leaves.
        exit_code: the agent's exit code (1: the job failed here).
        lost_work: the end lost work (logged as a warning, not as information).
    """

    reason: str
    exit_code: int = 0
    lost_work: bool = False


class PlanSource(Protocol):
    """Where the newest plan read from etcd is kept (the agent's watches)."""

    @property
    def latest_plan(self) -> Plan | None: ...


class Tier(Protocol):
    """How a node's workers are run: started, supervised until the agent leaves, stopped."""

    @property
    def workers(self) -> Mapping[int, WorkerProcess]:
        """The running (or exited, not yet replaced) workers by local rank."""
        ...

    @property
    def generation(self) -> int:
        """The generation whose workers it launched (0: workers are not per generation)."""
        ...

    @property
    def launched_at(self) -> float | None:
        """When that generation's workers were all launched (wall clock)."""
        ...

    @property
    def progress_at(self) -> float | None:
        """When every one of them first printed a line (0.0: not yet; None: not told)."""
        ...

    def start(self) -> None:
        """Start what runs before the first plan (workers, or warm standbys)."""

    def supervise(self) -> Outcome:
        """Run until the agent should leave (or ``stop`` is set); say why."""
        ...

    def close(self) -> None:
        """Stop every process it started (the stop sequence) and wait for their output."""

    def pids(self) -> list[int]:
        """Every process it runs now (workers and standbys), for the registration."""
        ...
