"""Contracts of the node side: worker environment, errors, stateful objects.

The node agent starts workers with the environment described by
:class:`WorkerEnv`; the worker runtime (:mod:`agents.runtime`) reads it.  The
worker runtime never imports the controller: the two meet only through etcd
keys (:mod:`orchestrator.state.keys`) and the records stored there
(:mod:`orchestrator.state.records`).

Inside the training process, the session (:class:`agents.runtime.Session`)
owns one record of where its worker stands (``WorkerState``); its parts
(joining a generation, durable saves, the sharded recovery tiers) read it
through :class:`WorkerView` and return what changed, which the session
applies.  :class:`DurableState` is what joining a generation needs of the
durable checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ENV_ADDRESS",
    "ENV_ETCD",
    "ENV_ETCD_CA",
    "ENV_ETCD_CERT",
    "ENV_ETCD_KEY",
    "ENV_ETCD_PASSWORD",
    "ENV_ETCD_USER",
    "ENV_JOB",
    "ENV_LOCAL_RANK",
    "ENV_LOCAL_WORLD_SIZE",
    "ENV_NODE",
    "ENV_RECOVERY",
    "PREIMPORTS",
    "RECOVERY_IN_PROCESS",
    "RECOVERY_RESTART",
    "AgentError",
    "DurableState",
    "JobEndedError",
    "RecoveryError",
    "Resumed",
    "StateLostError",
    "StateMismatchError",
    "Stateful",
    "StorageFaultError",
    "UnequalSitesError",
    "WorkerEnv",
    "WorkerView",
]

# Environment variables the agent sets for each worker.
ENV_JOB = "RINGMASTER_JOB"
ENV_NODE = "RINGMASTER_NODE"
ENV_ETCD = "RINGMASTER_ETCD"
ENV_ETCD_CA = "RINGMASTER_ETCD_CA"
ENV_ETCD_CERT = "RINGMASTER_ETCD_CERT"
ENV_ETCD_KEY = "RINGMASTER_ETCD_KEY"
ENV_ETCD_USER = "RINGMASTER_ETCD_USER"
ENV_ETCD_PASSWORD = "RINGMASTER_ETCD_PASSWORD"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_ADDRESS = "RINGMASTER_ADDRESS"
#: The job's recovery tier (``fault_tolerance.recovery`` resolved): one of the two below.
ENV_RECOVERY = "RINGMASTER_RECOVERY"
RECOVERY_IN_PROCESS = "in_process"
RECOVERY_RESTART = "restart"

#: What a warm worker imports before it waits (a standby of the restart tier, a spare of
#: the in-process tier): what a torchrun script's first DDP or DataLoader would import lazily
#: (``torch._dynamo`` alone takes about a second here).
PREIMPORTS = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.utils.data",
    "torch._dynamo",
)


class AgentError(Exception):
    """Base of every error raised by the ``agents`` package."""


class RecoveryError(AgentError):
    """The job could not be recovered in-process (e.g. too many failures of one step)."""


class StateLostError(AgentError):
    """Training state is gone from every live copy and no durable checkpoint holds it."""


class JobEndedError(AgentError):
    """The job reached a terminal phase while this worker waited for work."""


class StateMismatchError(AgentError, ValueError):
    """A state another rank sent does not fit this worker's (the sites or ranks run
    different models): the script's error, not a peer's failure."""


class UnequalSitesError(StateMismatchError):
    """The generation's sites differ in size while the model is sharded in each site:
    reported, and the controller plans sites of one size (not the script's error)."""


class StorageFaultError(AgentError):
    """The job's checkpoints cannot be used, by its own rule: the job fails with this.

    Raised in the training process (:mod:`agents.runtime.storage_faults`, and by a
    join that resumes from a checkpoint it cannot use).

    Attributes:
        fault: ``storage`` (``checkpoint.url`` cannot be written or read, or too
            many saves failed in a row) or ``checkpoint`` (the checkpoint to
            resume from cannot be used).
    """

    def __init__(self, message: str, fault: str = "storage") -> None:
        super().__init__(message)
        self.fault = fault


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker learns from its agent through the environment."""

    job: str
    node: str
    local_rank: int
    local_world_size: int
    etcd_endpoints: str
    address: str = "127.0.0.1"
    recovery: str = RECOVERY_IN_PROCESS
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = field(default=None, repr=False)

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> WorkerEnv | None:
        """The worker's env, or None when not started by a ringmaster agent."""
        env = dict(os.environ if environ is None else environ)
        if ENV_JOB not in env:
            return None
        return cls(
            job=env[ENV_JOB],
            node=env[ENV_NODE],
            local_rank=int(env.get(ENV_LOCAL_RANK, "0")),
            local_world_size=int(env.get(ENV_LOCAL_WORLD_SIZE, "1")),
            etcd_endpoints=env[ENV_ETCD],
            address=env.get(ENV_ADDRESS, "127.0.0.1"),
            recovery=env.get(ENV_RECOVERY, RECOVERY_IN_PROCESS),
            etcd_ca=env.get(ENV_ETCD_CA),
            etcd_cert=env.get(ENV_ETCD_CERT),
            etcd_key=env.get(ENV_ETCD_KEY),
            etcd_user=env.get(ENV_ETCD_USER),
            etcd_password=env.get(ENV_ETCD_PASSWORD),
        )

    def to_environ(self) -> dict[str, str]:
        out = {
            ENV_JOB: self.job,
            ENV_NODE: self.node,
            ENV_LOCAL_RANK: str(self.local_rank),
            ENV_LOCAL_WORLD_SIZE: str(self.local_world_size),
            ENV_ETCD: self.etcd_endpoints,
            ENV_ADDRESS: self.address,
            ENV_RECOVERY: self.recovery,
        }
        optional = {
            ENV_ETCD_CA: self.etcd_ca,
            ENV_ETCD_CERT: self.etcd_cert,
            ENV_ETCD_KEY: self.etcd_key,
            ENV_ETCD_USER: self.etcd_user,
            ENV_ETCD_PASSWORD: self.etcd_password,
        }
        out.update({k: v for k, v in optional.items() if v})
        return out


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (modules, optimizers...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class WorkerView(Protocol):
    """One worker as the runtime's parts read it; they never write it.

    The session's ``WorkerState`` (:mod:`agents.runtime.worker_state`) is one.
    A part that changes where the worker stands returns the change (a joined
    generation, a restored step) and the session applies it.
    """

    @property
    def rank(self) -> int:
        """Global rank in the current generation (-1 before the first)."""
        ...

    @property
    def world_size(self) -> int:
        """Ranks in the current generation (0 before the first)."""
        ...

    @property
    def step(self) -> int:
        """Steps completed (the step the worker trains next)."""
        ...

    @property
    def has_state(self) -> bool:
        """The tracked objects hold the state of :attr:`step` (a spare's hold none)."""
        ...

    @property
    def tracked(self) -> Mapping[str, Stateful]:
        """What the script tracked (``session.track``): model, optimizer, ..."""
        ...

    @property
    def hook(self) -> Any:
        """The current generation's comm hook (with per-rank state), or None."""
        ...


@dataclass(frozen=True)
class Resumed:
    """A durable checkpoint that a generation's ranks restored."""

    #: the step it holds (the step the worker trains next)
    step: int
    #: where it was read from
    url: str | None


class DurableState(Protocol):
    """What joining a generation needs of durable checkpoints (the runtime's ``Saving``)."""

    @property
    def url(self) -> str:
        """Where the job's durable checkpoints go (the job file's ``checkpoint.url``)."""
        ...

    def open(self, first: bool) -> None:
        """Open the generation's checkpointer (collective); ``first``: the job's first."""
        ...

    def can_resume(self) -> bool:
        """The tracked objects make a checkpoint's state (a ``model`` is tracked)."""
        ...

    def resume(self, world_size: int) -> Resumed | None:
        """Load the newest durable state on every rank (collective), if there is one."""
        ...
