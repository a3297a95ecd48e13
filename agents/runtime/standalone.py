"""The runtime outside ringmaster: the same script under plain ``torchrun``.

:func:`agents.runtime.init` returns a :class:`StandaloneSession` when no
ringmaster agent started the worker (``RINGMASTER_JOB`` is not set).  It
offers the same calls as :class:`agents.runtime.Session` with what torchrun
itself gives: the process group from torchrun's environment (``env://``),
plain ``DistributedDataParallel`` and no hot-swap.  A failure ends the run as
it always does under torchrun; the script's own checkpoints are what a
restart resumes from.  A script started with plain ``python`` (no torchrun
environment) trains as a single rank.

What has no meaning here is said once in the log, not silently dropped:
``on_save`` callbacks never run (no job file asks for saves) and metrics
passed to ``report`` are kept in :attr:`StandaloneSession.metrics` only.
There is no job file: :attr:`StandaloneSession.spec` holds a job file's
defaults (``max_steps`` 0: the script's own count decides).  The model is
plain DDP: ``wrap(sharding=...)`` other than ``ddp``, ``mesh`` and the
options of those need an agent, and are refused with a message saying so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from agents.api import Stateful
from agents.runtime.process_group import quiesce
from orchestrator.spec.job import EntrypointSpec, JobSpec

__all__ = ["StandaloneSession"]

log = logging.getLogger("ringmaster.worker")

#: torchrun's default collective timeout is torch's; kept as is.
_GROUP_TIMEOUT = timedelta(minutes=10)


class StandaloneSession:
    """A worker's session without an agent: torchrun's semantics, the runtime's calls."""

    generation = 1
    recoveries = 0
    last_recovery_s: float | None = None
    restored_from: str | None = None
    paused: str | None = None
    #: no delayed sync here: no outer steps
    outer_steps: tuple[int, ...] = ()

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.rank = int(env.get("RANK", "0"))
        self.world_size = int(env.get("WORLD_SIZE", "1"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.step = 0
        self.finished = False
        self.tracked: dict[str, Stateful] = {}
        self.metrics: dict[str, float] = {}
        #: a job file's defaults (there is none): ``max_steps`` 0, the script decides
        script = EntrypointSpec(script=sys.argv[0] if sys.argv and sys.argv[0] else "-")
        self.spec = JobSpec(name="standalone", entrypoint=script).validate()
        local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
        self.device = _device(self.local_rank, local_world)
        self._owns_group = False
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if "MASTER_ADDR" in env:
                dist.init_process_group(backend, timeout=_GROUP_TIMEOUT)
            else:  # plain `python script.py`: a group of one
                dist.init_process_group(
                    backend, store=dist.HashStore(), rank=0, world_size=1, timeout=_GROUP_TIMEOUT
                )
            self._owns_group = True
        log.warning(
            "rank %d/%d: not started by a ringmaster agent; training with the plain "
            "process group and DDP, without hot-swap (a failure ends this run, as under "
            "torchrun)",
            self.rank,
            self.world_size,
        )

    @property
    def worker(self) -> str:
        """This worker's name in logs: its global rank (there is no node name here)."""
        return f"rank{self.rank}"

    @property
    def step_failed(self) -> bool:
        """Always False: a failed step raises out of :meth:`guard` here."""
        return False

    def wrap(
        self,
        module: nn.Module,
        hook_installer: Any = None,
        *,
        sharding: str | None = None,
        shard_size: int | None = None,
        redundancy_every_steps: int | None = None,
        mesh: Any = None,
        tensor_plan: Any = None,
        pipeline: Any = None,
    ) -> DistributedDataParallel:
        """Plain DDP (``device_ids`` set on a GPU); ``hook_installer`` is called on it once.

        Raises:
            ValueError: ``sharding`` other than ``ddp``, or an option of the sharded
                modes (``mesh``, ``shard_size``, ...): they need an agent.
        """
        sharded = {
            "shard_size": shard_size,
            "redundancy_every_steps": redundancy_every_steps,
            "mesh": mesh,
            "tensor_plan": tensor_plan,
            "pipeline": pipeline,
        }
        given = [k for k, v in sharded.items() if v is not None]
        if sharding not in (None, "ddp") or given:
            what = f"sharding={sharding!r}" if sharding not in (None, "ddp") else f"{given[0]}=..."
            raise ValueError(
                f"wrap({what}) needs a ringmaster agent (`ringmaster run` or `submit`): "
                "outside one, the runtime trains a plain DDP model only"
            )
        if self.device.type == "cuda":
            ddp = DistributedDataParallel(module.to(self.device), device_ids=[self.device.index])
        else:
            ddp = DistributedDataParallel(module)
        if hook_installer is not None:
            hook_installer(ddp)
        return ddp

    def track(self, **objects: Stateful) -> None:
        """Check the objects as :meth:`agents.runtime.Session.track` does; nothing is synced."""
        for name, obj in objects.items():
            if not isinstance(obj, Stateful):
                raise TypeError(f"{name} has no state_dict()/load_state_dict()")
            self.tracked[name] = obj

    def on_save(self, fn: Callable[[Any, str], None]) -> None:
        """Accepted for the same script's sake; no save is ever due without a job file."""
        log.info("on_save: no job file asks for saves outside ringmaster; the callback never runs")

    def report(self, **metrics: float) -> None:
        self.metrics.update({k: float(v) for k, v in metrics.items()})

    def steps(self, total: int | None = None) -> Iterator[int]:
        """Yield ``0 .. total - 1``; without ``total`` the loop never ends on its own."""
        self.step = 0
        while total is None or self.step < total:
            yield self.step
            self.step += 1
        self.finished = True

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """A plain block: an error propagates and ends the worker, as under torchrun."""
        yield

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            last = quiesce()  # held until the group is gone (see quiesce)
            dist.destroy_process_group()
            del last


def _device(local_rank: int, local_world: int) -> torch.device:
    """The local rank's GPU when every local rank has one (then NCCL), else the CPU
    (then gloo): every rank must choose the same backend."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and count >= local_world:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if count:
        log.warning(
            "%d local ranks but %d CUDA device(s): training on the CPU with gloo",
            local_world,
            count,
        )
    return torch.device("cpu")
