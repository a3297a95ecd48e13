"""Contracts of the Slurm door: errors, the allocation as Slurm describes it, a node's state.

Pure; imported by every module of :mod:`orchestrator.slurm` and by nothing of
theirs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from orchestrator.api import OrchestratorError

__all__ = [
    "DEFAULT_COMMAND_TIMEOUT",
    "LEAVING_FLAGS",
    "REQUEUE_SIGNAL",
    "Allocation",
    "NodeState",
    "NotInAllocationError",
    "SlurmCommandError",
    "SlurmError",
    "SlurmMissingError",
]

#: How long a Slurm client command (``scontrol``, ``sbatch``) may take before it counts
#: as failed: slurmctld answers in milliseconds, or is down.
DEFAULT_COMMAND_TIMEOUT = timedelta(seconds=30)

#: The signal Slurm sends the batch script ``slurm.signal_grace`` before the time
#: limit (``--signal=B:USR1@grace``): write the final checkpoint, then requeue.
REQUEUE_SIGNAL = "USR1"

#: Node state flags that mean the node is to leave on purpose: a drain
#: (``scontrol update state=drain``), a reboot asked for (``scontrol reboot ASAP``),
#: a node an administrator expects to fail (``state=fail``).
LEAVING_FLAGS = frozenset({"DRAIN", "REBOOT_REQUESTED", "FAIL"})


class SlurmError(OrchestratorError):
    """Base of the errors of :mod:`orchestrator.slurm`."""


class SlurmMissingError(SlurmError):
    """A Slurm client command is not installed here."""


class SlurmCommandError(SlurmError):
    """A Slurm command failed or did not answer in time (its message says which and why)."""


class NotInAllocationError(SlurmError):
    """A command that runs inside a Slurm allocation was started outside of one."""


@dataclass(frozen=True)
class Allocation:
    """The allocation a process runs in, as Slurm's environment describes it.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        nodes: how many nodes it has (``SLURM_JOB_NUM_NODES``).
        node_list: their names, compressed as Slurm writes them (``node[1-3]``).
        node: the node this process runs on (``SLURMD_NODENAME``).
        restarts: how many times Slurm requeued the job before (``SLURM_RESTART_COUNT``).
    """

    job_id: str
    nodes: int
    node_list: str
    node: str
    restarts: int = 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> Allocation:
        """The allocation of ``env`` (default: this process's environment).

        Raises:
            NotInAllocationError: no ``SLURM_JOB_ID``: not inside an allocation.
        """
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            raise NotInAllocationError(
                "not inside a Slurm allocation (SLURM_JOB_ID is not set): submit the job "
                "with `ringmaster slurm submit JOB_FILE`, or run this in an sbatch script"
            )
        nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
        return cls(
            job_id=job_id,
            nodes=int(nodes),
            node_list=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""),
            node=env.get("SLURMD_NODENAME", ""),
            restarts=int(env.get("SLURM_RESTART_COUNT") or 0),
        )


@dataclass(frozen=True)
class NodeState:
    """One node as ``scontrol show node`` describes it.

    Attributes:
        name: the node's name.
        base: its base state (``IDLE``, ``MIXED``, ``ALLOCATED``, ``DOWN``...).
        flags: the flags after it (``DRAIN``, ``COMPLETING``, ``NOT_RESPONDING``...).
        reason: the reason an administrator gave (``Reason=``), if any.
        address: ``NodeAddr``.
    """

    name: str
    base: str
    flags: frozenset[str] = field(default_factory=frozenset)
    reason: str = ""
    address: str = ""

    @property
    def leaving(self) -> bool:
        """The node is to leave on purpose (drained, a reboot asked for): see
        :data:`LEAVING_FLAGS`."""
        return bool(self.flags & LEAVING_FLAGS)

    @property
    def down(self) -> bool:
        return self.base == "DOWN"

    def describe(self) -> str:
        state = "+".join([self.base, *sorted(self.flags)])
        return f"{state} ({self.reason})" if self.reason else state
