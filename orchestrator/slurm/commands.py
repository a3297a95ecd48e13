"""Every call ringmaster makes to Slurm's client commands: sbatch, scontrol.

Runs in ``ringmaster slurm submit`` (sbatch), in the driver inside the
allocation (``scontrol requeue``, the batch host's address) and in each agent
(its node's state and switches).  Each call is bounded by a timeout and fails
as :class:`~orchestrator.slurm.api.SlurmCommandError` with the command and
what it printed; what they print is read by :mod:`orchestrator.slurm.scontrol_text`.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from datetime import timedelta

from orchestrator.slurm.api import (
    DEFAULT_COMMAND_TIMEOUT,
    NodeState,
    SlurmCommandError,
    SlurmError,
    SlurmMissingError,
)
from orchestrator.slurm.scontrol_text import parse_job_id, parse_node, topology_labels

__all__ = [
    "node_labels",
    "node_state",
    "release_now",
    "requeue",
    "run_slurm",
    "slurm_available",
    "submit_script",
]


def slurm_available(command: str = "sbatch") -> bool:
    """Whether ``command`` is installed here."""
    return shutil.which(command) is not None


def run_slurm(
    argv: Sequence[str],
    *,
    stdin: str | None = None,
    timeout: timedelta = DEFAULT_COMMAND_TIMEOUT,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command and return what it printed.

    Raises:
        SlurmMissingError: the command is not installed.
        SlurmCommandError: it exited with an error (``check``) or took longer than
            ``timeout``; the message holds the command line and its error output.
    """
    if shutil.which(argv[0]) is None:
        raise SlurmMissingError(
            f"{argv[0]} is not installed here: run this on a machine of the Slurm cluster "
            "(a login node), where Slurm's client commands are on PATH"
        )
    shown = " ".join(argv)
    try:
        done = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout.total_seconds(),
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise SlurmCommandError(
            f"`{shown}` did not answer within {timeout.total_seconds():g}s: is slurmctld up "
            "(`scontrol ping`)?"
        ) from e
    if check and done.returncode != 0:
        said = (done.stderr or done.stdout).strip() or "nothing"
        raise SlurmCommandError(f"`{shown}` failed with exit code {done.returncode}: {said}")
    return done


def submit_script(script: str, extra: Sequence[str] = ()) -> str:
    """Submit a batch script (given as text, on sbatch's standard input); the job id.

    Raises:
        SlurmCommandError: sbatch refused it (its message says why).
    """
    done = run_slurm(["sbatch", "--parsable", *extra], stdin=script)
    return parse_job_id(done.stdout)


def node_state(node: str, timeout: timedelta = DEFAULT_COMMAND_TIMEOUT) -> NodeState:
    """``scontrol show node NODE``, read.

    Raises:
        SlurmCommandError: scontrol failed or printed no such node.
    """
    done = run_slurm(["scontrol", "-o", "show", "node", node], timeout=timeout)
    return parse_node(done.stdout)


def node_labels(node: str) -> dict[str, str]:
    """The topology labels of ``node`` from Slurm's switches (none without a topology
    plugin, or when scontrol cannot tell)."""
    try:
        done = run_slurm(["scontrol", "show", "topology", node], check=False)
    except SlurmError:
        return {}
    return topology_labels(done.stdout) if done.returncode == 0 else {}


def requeue(job_id: str) -> None:
    """Put a job back in the queue (``scontrol requeue``): its processes are ended.

    Raises:
        SlurmCommandError: scontrol refused (a job submitted with ``--no-requeue``...).
    """
    run_slurm(["scontrol", "requeue", job_id])


def release_now(job_id: str) -> None:
    """Let a requeued job start at once: Slurm holds a requeued job back for a while
    (its ``BeginTime``, two minutes in 22.05); an administrator may lift that.

    Raises:
        SlurmCommandError: scontrol refused (only an operator or administrator may).
    """
    run_slurm(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])
