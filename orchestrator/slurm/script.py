"""The batch script of a ringmaster job and the ``srun`` line of its agents.

Pure: a validated job spec (its ``slurm`` section with the command line's
overrides, :func:`with_overrides`) goes in, text and argument lists come out.
``ringmaster slurm script`` prints :func:`batch_script`; inside the allocation
the driver (:mod:`orchestrator.slurm.allocation`) starts the agents with
:func:`agent_step`.

What keeps a lost node from ending the job, and why each option is there:

* ``#SBATCH --no-kill``: Slurm takes a failed node out of the allocation
  instead of revoking the whole allocation (the default).
* ``srun --no-kill --kill-on-bad-exit=0 --wait=0``: the agents' step loses
  that node's task and goes on (``--no-kill`` on the step as well); an agent
  that exits with an error ends no other (``--kill-on-bad-exit=0``, which
  overrides a cluster's ``KillOnBadExit=1``); and the tasks left are not
  killed some time after the first one ends (``--wait=0`` overrides a
  cluster's ``WaitTime``).  A drained node's agent leaves on purpose and
  exits 0.
* ``#SBATCH --signal=B:USR1@<slurm.signal_grace>``: the batch script (the
  driver, which it ``exec``\\ s) gets SIGUSR1 that long before the time limit,
  to write the final checkpoint; ``--requeue`` lets the driver put the job
  back in the queue after it (``scontrol requeue``), and ``--open-mode=append``
  keeps the earlier runs' output in the same file.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from typing import Any

from orchestrator.slurm.api import REQUEUE_SIGNAL
from orchestrator.spec.job import JobSpec

__all__ = [
    "AGENT_STEP_NAME",
    "DEFAULT_OUTPUT",
    "agent_command",
    "agent_step",
    "allocation_nodes",
    "batch_script",
    "directives",
    "with_overrides",
]

#: Where the batch script's output goes unless ``--output`` says otherwise
#: (sbatch's patterns: ``%x`` the job name, ``%j`` the job id).
DEFAULT_OUTPUT = "ringmaster-%x-%j.out"

#: The name of the agents' job step (``squeue -s`` shows it).
AGENT_STEP_NAME = "ringmaster-agents"


def with_overrides(spec: JobSpec, **overrides: Any) -> JobSpec:
    """``spec`` with its ``slurm`` fields replaced by the command line's (None: not given).

    List fields given on the command line are added to the job file's.

    Raises:
        SpecError: the result is not valid (the problem names ``slurm.<field>``).
    """
    given = {k: v for k, v in overrides.items() if v is not None and v != ()}
    current = spec.slurm
    for name in ("extra", "modules", "setup"):
        if name in given:
            given[name] = [*getattr(current, name), *given[name]]
    out = dataclasses.replace(spec, slurm=dataclasses.replace(current, **given))
    return out.validate()


def allocation_nodes(spec: JobSpec) -> int:
    """How many nodes the allocation asks for: every training node and every spare."""
    return spec.nodes.max + spec.nodes.spares


def directives(spec: JobSpec, *, workdir: str, output: str = DEFAULT_OUTPUT) -> list[str]:
    """The ``#SBATCH`` options of the job's batch script (without the ``#SBATCH``)."""
    s = spec.slurm
    out = [
        f"--job-name={spec.name}",
        f"--nodes={allocation_nodes(spec)}",
        "--ntasks-per-node=1",
        "--no-kill",
        "--requeue" if s.requeue else "--no-requeue",
        f"--signal=B:{REQUEUE_SIGNAL}@{round(s.signal_grace.total_seconds())}",
        "--open-mode=append",
        f"--output={_value(output)}",
        f"--chdir={_value(workdir)}",
    ]
    if s.exclusive:
        out.append("--exclusive")
    for flag, value in (
        ("--partition", s.partition),
        ("--account", s.account),
        ("--qos", s.qos),
        ("--time", s.time),
    ):
        if value:
            out.append(f"{flag}={value}")
    if s.gpus_per_node:
        out.append(f"--gpus-per-node={s.gpus_per_node}")
    return out + list(s.extra)


def _value(text: str) -> str:
    """A directive's value as sbatch reads it: in double quotes when it holds a space."""
    return f'"{text}"' if any(c.isspace() for c in text) else text


def batch_script(
    spec: JobSpec,
    job_file: str,
    *,
    workdir: str,
    ringmaster: Sequence[str],
    etcd: Sequence[str] = (),
    output: str = DEFAULT_OUTPUT,
) -> str:
    """The batch script: its ``#SBATCH`` lines, the modules and setup lines, and the
    driver (``ringmaster slurm run``) that it becomes.

    Args:
        spec: the job, valid, with its ``slurm`` overrides applied.
        job_file: the job file's absolute path (the batch host reads it).
        workdir: the directory the job runs in (``--chdir``; relative paths of the
            job file, such as its entrypoint, are under it).
        ringmaster: how to run ringmaster on the nodes
            (``[sys.executable, "-m", "orchestrator.cli"]``, or ``["ringmaster"]``).
        etcd: etcd endpoints to use instead of an embedded etcd (none: the job
            file's ``rendezvous.endpoints``, else an etcd on the batch host).
        output: the script's output file (sbatch's ``--output``).
    """
    nodes = allocation_nodes(spec)
    lines = [
        "#!/bin/bash",
        f"# ringmaster job {spec.name!r} in one Slurm allocation of {nodes} nodes: "
        f"{_training(spec)}, {spec.nodes.spares} warm spare(s).",
        "# Written by `ringmaster slurm script`; submit it with sbatch or `ringmaster slurm "
        "submit`.",
        *(f"#SBATCH {d}" for d in directives(spec, workdir=workdir, output=output)),
        "",
        "set -e",
    ]
    if spec.slurm.modules:
        lines.append("module load " + " ".join(shlex.quote(m) for m in spec.slurm.modules))
    lines += list(spec.slurm.setup)
    driver = [*ringmaster, "slurm", "run", job_file]
    if etcd:
        driver += ["--etcd", ",".join(etcd)]
    lines += [
        "# etcd and the controller here, one agent per node (srun); the job's exit status",
        "exec " + shlex.join(driver),
        "",
    ]
    return "\n".join(lines)


def _training(spec: JobSpec) -> str:
    n = spec.nodes
    return f"{n.max} training" if n.min == n.max else f"{n.min} to {n.max} training"


def agent_command(ringmaster: Sequence[str], job: str, etcd_args: Sequence[str]) -> list[str]:
    """What each task of the agents' step runs: ``ringmaster slurm agent`` for ``job``."""
    return [*ringmaster, "slurm", "agent", "--job", job, *etcd_args]


def agent_step(nodes: int, command: Sequence[str]) -> list[str]:
    """The ``srun`` line that starts one agent on each of ``nodes`` nodes and survives
    the loss of any of them (see the module docstring)."""
    return [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        "--no-kill",
        "--kill-on-bad-exit=0",
        "--wait=0",
        f"--job-name={AGENT_STEP_NAME}",
        *command,
    ]
