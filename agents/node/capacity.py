"""Whether this node can run a job's workers: ``nproc_per_node`` against its CPUs or GPUs.

Runs in the node agent, once the job's spec is read and before any worker is
started or the node registered.  Each local rank is a process; a job that
asks for more on a node than the node has CPUs (or GPUs, for a job on CUDA:
each worker of the runtime binds the GPU of its local rank) would have the
agent start processes the machine cannot run, so the agent refuses with one
line, unless the job file says ``oversubscribe: true`` (tiny workers on a
small machine, a test).  :func:`capacity_problem` decides from counts it is
given; :func:`usable_cpus` and :func:`visible_gpus` count them here, without
torch (the agent does not import it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from orchestrator.spec.job import Backend, JobSpec

__all__ = ["capacity_problem", "usable_cpus", "uses_cuda", "visible_gpus"]

#: Where the NVIDIA driver lists the GPUs of this machine (one entry each).
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity: a cpuset or ``taskset`` counted)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def visible_gpus(env: Mapping[str, str] | None = None, driver: Path = NVIDIA_GPUS) -> int:
    """GPUs the workers will see: ``CUDA_VISIBLE_DEVICES`` when set, else the driver's list.

    0 where neither says (no NVIDIA driver, or one this process cannot read).
    """
    env = os.environ if env is None else env
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        devices = [d.strip() for d in given.split(",") if d.strip()]
        # CUDA stops at the first invalid entry ("-1" hides every device)
        count = 0
        for d in devices:
            if d.startswith("-"):
                break
            count += 1
        return count
    try:
        return sum(1 for _ in driver.iterdir())
    except OSError:
        return 0


def uses_cuda(spec: JobSpec, gpus: int, in_process: bool) -> bool:
    """Whether the job's workers run on GPUs on a node that shows ``gpus`` of them.

    NCCL or GPUs in the pod's resources say so; so does any GPU seen for the
    in-process tier, whose runtime binds the GPU of each local rank.
    """
    if spec.comm.backend is Backend.NCCL or spec.resources.gpus > 0:
        return True
    return in_process and gpus > 0


def capacity_problem(
    spec: JobSpec, node: str, cpus: int, gpus: int, in_process: bool = True
) -> str | None:
    """One line when ``nproc_per_node`` is more than this node can run, else None.

    The limit is the node's GPUs for a job on CUDA (where it shows any; a node
    that shows none is left to the workers, which say what they miss), its
    CPUs otherwise.  ``oversubscribe: true`` in the job file lifts it.
    """
    nproc = spec.nproc_per_node
    cuda = uses_cuda(spec, gpus, in_process) and gpus > 0
    if spec.oversubscribe and cuda and nproc > gpus and spec.comm.backend is not Backend.GLOO:
        return (
            f"node {node}: nproc_per_node ({nproc:,}) is more than the {gpus} GPU"
            f"{'s' if gpus != 1 else ''} it shows, and NCCL takes one worker per GPU "
            f"(comm.backend: {spec.comm.backend.value}): set comm.backend: gloo for the "
            f"workers to share them (oversubscribe), or nproc_per_node to at most {gpus}"
        )
    if spec.oversubscribe:
        return None
    if cuda:
        limit, what = gpus, f"GPU{'s' if gpus != 1 else ''} it shows"
    else:
        limit, what = cpus, f"CPU{'s' if cpus != 1 else ''} it may use"
    if nproc <= limit:
        return None
    return (
        f"node {node}: nproc_per_node ({nproc:,}) is more than the {limit} {what}: "
        f"set nproc_per_node to at most {limit}, or `oversubscribe: true` in the job file "
        "to start them anyway"
    )
