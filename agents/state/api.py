"""The contract between the worker runtime and recovery: a join, handed to a kind of state.

Runs in the training process.  A worker holds its training state in one of a
few *kinds*, named by :attr:`Holdings.kind`:

* :data:`REPLICAS`: DDP (or nothing wrapped): every rank holds the whole model;
* :data:`SLICES`: a sharded model (``fsdp``, ``hsdp``, a mesh): each rank a slice;
* :data:`SITES`: a delayed sync with a DDP model in each site;
* :data:`SITE_SLICES`: a delayed sync with an FSDP2 model in each site.

When a worker joins a generation, the runtime (:mod:`agents.runtime.generation`)
forms the generation's process groups and opens its checkpointer, then hands
the rest of the join to the :class:`Recovery` of the kind of state the worker
holds, picked from a table keyed by kind.  The recovery brings this rank to
the freshest state some rank still holds, or to the newest durable checkpoint
(or leaves a new job's initial values), and returns what it restored
(:class:`Restored`); the runtime applies it.  The implementations, one per
kind, live in :mod:`agents.recovery`; the table the runtime picks from is
handed to it by whoever builds the session (:func:`agents.runtime.init`).
The runtime and recovery never import each other: both import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch import nn

    from agents.api import DurableState, WorkerView
    from agents.state.buddy_copies import BuddyCopies
    from agents.state.sharding import ShardedModel
    from agents.sync.outer_sync import OuterSync
    from orchestrator.state.records import Plan

__all__ = [
    "REPLICAS",
    "SITES",
    "SITE_SLICES",
    "SLICES",
    "Holdings",
    "Joining",
    "Recovery",
    "Restored",
]

#: The kinds of state (:attr:`Holdings.kind`, the keys of the recoveries' table).
REPLICAS = "replicas"
SLICES = "slices"
SITES = "sites"
SITE_SLICES = "site_slices"


class Holdings(Protocol):
    """What a worker's script wrapped, as a recovery reads it (never writes it).

    The runtime's :class:`~agents.runtime.wrapping.WrappedModels` is one.
    """

    @property
    def kind(self) -> str:
        """Which kind of state this is: the key of its recovery in the table."""
        ...

    @property
    def sharded(self) -> ShardedModel | None:
        """The sharded model (``SLICES``, ``SITE_SLICES``), else None."""
        ...

    @property
    def buddies(self) -> BuddyCopies | None:
        """The sharded model's buddy copies (``fsdp`` with redundancy), else None."""
        ...

    @property
    def outer(self) -> OuterSync | None:
        """A delayed sync's outer loop (``SITES``, ``SITE_SLICES``), else None."""
        ...

    def replica(self) -> nn.Module | None:
        """The one DDP model whose replicas every rank at one step holds alike (its
        gradients are averaged at every step), else None: the ranks that hold it
        may then each send a share of it."""
        ...


@dataclass(frozen=True)
class Joining:
    """One worker's join of a generation, once its groups formed: what every recovery gets."""

    #: the generation joined
    plan: Plan
    #: this worker's global rank in it
    rank: int
    #: workers of this worker's node (a buddy is the same local rank on the next node)
    nproc: int
    device: torch.device
    #: the generation's gloo control group (None: the default group)
    control: dist.ProcessGroup | None
    #: the generation's collective timeout (the groups a recovery forms start with it)
    timeout: timedelta
    #: what an exchange of the buddy copies may take (``fault_tolerance.hang_timeout``)
    copies_timeout: timedelta
    #: the worker as it stands (its step and tracked objects)
    held: WorkerView
    #: the tracked objects hold the state of ``held.step`` (False for a replacement,
    #: or a worker fenced out while away)
    holds_state: bool
    #: the durable checkpoints, opened on this generation's group
    durable: DurableState

    @property
    def world_size(self) -> int:
        return self.plan.world_size


@dataclass(frozen=True)
class Restored:
    """What a join restored (the runtime applies it and records it in its telemetry)."""

    #: the step every rank trains next
    step: int
    #: the tracked objects hold the state of ``step``
    has_state: bool
    #: the durable checkpoint the state was resumed from (None: from memory, or fresh)
    restored_from: str | None = None
    #: what served a sharded model's slices (``twin``, ``buddy``, ``durable``...;
    #: None: not told, as for replicas)
    source: str | None = None
    #: completed steps lost (the newest live step minus ``step``)
    lost: int = 0


class Recovery(Protocol):
    """How one kind of state is brought back when a worker joins a generation."""

    def join(self, joining: Joining, holdings: Holdings) -> Restored:
        """Bring this rank's state to the generation's (a collective: every rank calls
        the recovery of the same kind).

        Raises:
            RuntimeError: a collective broke (a member is gone again).
            StateLostError: state was held but every copy of some part of it is gone,
                and no durable checkpoint holds it.
            StateMismatchError: the state another rank sent does not fit this worker's.
            StorageFaultError: the checkpoint to resume from cannot be used.
        """
        ...
