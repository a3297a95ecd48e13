"""Data for elastic training: every step reads its global batch, whoever the ranks are.

Runs in the training process.  A step's data is addressed by the step, not
by an iterator's hidden position.  Step ``s`` consumes the global positions
``[s * B, (s + 1) * B)`` of one endless stream (``B`` is the fixed global
batch size), dealt out round-robin by rank and world size in the current
generation: rank ``r`` of ``w`` takes ``s * B + r``, ``s * B + r + w``, ...
The stream and the deal are ringmaster's one sample-position convention,
:mod:`checkpoint.data_position`, which :class:`checkpoint.ElasticSampler`
follows too (see docs/training-loops.md).  So:

* a step that runs again after a recovery reads the same global batch;
* after a change of world size the step's positions are dealt out anew,
  and no sample is skipped or repeated;
* a resume from a durable checkpoint (at any world size) continues at the
  exact sample: the position is the restored step times ``B``, so durable
  checkpoints and state sync carry it without tracking anything.

:class:`ElasticLoader` reads the shares through a torch ``DataLoader`` (worker
processes, prefetching, ``collate_fn``, pinned memory): a batch sampler yields
this rank's indices step after step from where the iterator started.  When
the script asks for another step than the next one prefetched, or the rank or
world size changed, the iterator is rebuilt from that step, so prefetched
batches of a broken generation are never served.

In a training loop::

    loader = ElasticLoader(dataset, session, global_batch_size=64, num_workers=2)
    for step in session.steps():
        with session.guard():
            x, y = loader.batch(step)
            loss = F.cross_entropy(model(x), y, reduction="sum") * loader.loss_scale
            ...

Random transforms inside the dataset should be seeded by the sample's index,
so that a sample read again (a step that runs again) looks the same.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset

from checkpoint.data_position import GlobalOrder, rank_positions, share_size

__all__ = ["DataLoaderError", "ElasticLoader", "Placement"]

log = logging.getLogger("ringmaster.worker")


class Placement(Protocol):
    """Where this process trains now: a :class:`~agents.runtime.Session` is one."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class DataLoaderError(ValueError):
    """The loader was set up or asked for something it cannot serve."""


class _RankBatches:
    """Batch sampler: this rank's indices for step ``start``, ``start + 1``, ...

    The loader sets ``start``, ``rank`` and ``world_size`` before each new
    iterator; ``DataLoader`` calls ``iter()`` in the training process, also
    when persistent workers are reset.
    """

    def __init__(self, order: GlobalOrder, global_batch_size: int) -> None:
        self.order = order
        self.global_batch_size = global_batch_size
        self.start = 0
        self.rank = 0
        self.world_size = 1

    def __iter__(self) -> Iterator[list[int]]:
        step, rank, world = self.start, self.rank, self.world_size
        order = GlobalOrder(self.order.length, self.order.seed, self.order.shuffle)
        batch = self.global_batch_size
        while True:
            share = rank_positions(step * batch, (step + 1) * batch, rank, world)
            yield order.indices(share.start, share.stop, share.step)
            step += 1


class ElasticLoader:
    """Rank ``rank``'s share of step ``step``'s global batch, through a ``DataLoader``.

    Args:
        dataset: a map-style torch ``Dataset`` with ``len()``.
        placement: where this process trains (the :class:`~agents.runtime.Session`);
            its ``rank`` and ``world_size`` are read at every :meth:`batch`.
        global_batch_size: samples per step across all ranks; keep it fixed for
            a job (a resume finds its position as step times this number).
        seed: seed of the per-epoch permutations (the same on every rank).
        shuffle: False reads every epoch in dataset order.
        num_workers: ``DataLoader`` worker processes (0: read in this process).
        **loader_kwargs: further ``DataLoader`` arguments (``collate_fn``,
            ``pin_memory``, ``prefetch_factor``, ``persistent_workers``,
            ``timeout``, ``worker_init_fn``, ``multiprocessing_context``);
            ``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler`` and
            ``drop_last`` are the loader's own.

    Raises:
        DataLoaderError: the dataset has no length or is empty, the global
            batch size is not positive, or an argument the loader sets itself
            was given.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        placement: Placement,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        **loader_kwargs: Any,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise DataLoaderError(
                f"ElasticLoader needs a map-style dataset with len(); "
                f"{type(dataset).__name__} has none"
            )
        if global_batch_size < 1:
            raise DataLoaderError(f"global_batch_size must be at least 1, got {global_batch_size}")
        own = sorted(
            {"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(loader_kwargs)
        )
        if own:
            raise DataLoaderError(
                f"ElasticLoader sets {', '.join(own)} itself (from global_batch_size and seed); "
                "leave them out"
            )
        if len(dataset) < 1:
            raise DataLoaderError(f"the dataset is empty (length {len(dataset)}); give it samples")
        self.placement = placement
        self.global_batch_size = global_batch_size
        self.order = GlobalOrder(len(dataset), seed, shuffle)
        self._batches = _RankBatches(self.order, global_batch_size)
        # A private generator: building an iterator draws its workers' base seed
        # from it, not from torch's global RNG, which the training step owns.
        generator = torch.Generator().manual_seed(seed)
        self._loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_sampler=self._batches,
            num_workers=num_workers,
            generator=generator,
            **loader_kwargs,
        )
        self._iter: Iterator[Any] | None = None
        self._next_step = -1
        self._placed = (-1, 0)
        #: iterators built so far (the first, and one per step asked out of order)
        self.rebuilds = 0

    @property
    def dataset_length(self) -> int:
        return self.order.length

    def epoch(self, step: int) -> int:
        """The epoch that step ``step``'s first sample belongs to."""
        return step * self.global_batch_size // self.order.length

    def indices(
        self, step: int, rank: int | None = None, world_size: int | None = None
    ) -> list[int]:
        """Dataset indices of ``rank``'s share of step ``step`` (default: this rank's now)."""
        rank = self.placement.rank if rank is None else rank
        world = self.placement.world_size if world_size is None else world_size
        self._check_placement(rank, world)
        batch = self.global_batch_size
        share = rank_positions(step * batch, (step + 1) * batch, rank, world)
        return self.order.indices(share.start, share.stop, share.step)

    @property
    def share(self) -> int:
        """Samples this rank reads per step now (the ranks' shares differ by one at most)."""
        return share_size(self.global_batch_size, self.placement.rank, self.placement.world_size)

    @property
    def loss_scale(self) -> float:
        """Factor that turns this rank's summed loss into its part of the global mean.

        DDP averages gradients over ranks, so with ``loss = sum * loss_scale`` the
        gradient is that of the mean over the whole global batch, also when the
        shares are uneven (a world size that does not divide the batch).
        """
        return self.placement.world_size / self.global_batch_size

    def batch(self, step: int) -> Any:
        """This rank's share of step ``step``'s global batch, collated.

        Call it inside the guarded step.  The batch comes from the prefetching
        iterator when ``step`` is the next one it holds for this rank and world
        size; otherwise (a step that runs again, a new generation, a resume) the
        iterator is rebuilt from ``step``.

        Raises:
            DataLoaderError: ``step`` is negative or the world size is larger than
                the global batch size.
        """
        if step < 0:
            raise DataLoaderError(f"step must be 0 or more, got {step}")
        placed = (self.placement.rank, self.placement.world_size)
        if self._iter is None or step != self._next_step or placed != self._placed:
            self._rebuild(step, *placed)
        assert self._iter is not None
        out = next(self._iter)
        self._next_step = step + 1
        return out

    def _check_placement(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise DataLoaderError(
                f"rank {rank} is outside world size {world_size}: call batch() inside "
                "session.steps(), once the session has joined a generation"
            )
        if world_size > self.global_batch_size:
            raise DataLoaderError(
                f"global_batch_size ({self.global_batch_size}) is smaller than the world "
                f"size ({world_size}): some ranks would get no samples; raise it to at "
                f"least {world_size}"
            )

    def _rebuild(self, step: int, rank: int, world_size: int) -> None:
        self._check_placement(rank, world_size)
        if self._iter is not None:
            log.debug(
                "data iterator rebuilt at step %d (held step %d for rank %d of %d)",
                step,
                self._next_step,
                *self._placed,
            )
        # Drop the old iterator first: its workers shut down before new ones start.
        self._iter = None
        self._batches.start, self._batches.rank, self._batches.world_size = step, rank, world_size
        self._iter = iter(self._loader)
        self._placed = (rank, world_size)
        self._next_step = step
        self.rebuilds += 1

    def close(self) -> None:
        """Stop the worker processes (persistent ones too)."""
        self._iter = None
        # DataLoader keeps a persistent-workers iterator of its own.
        self._loader._iterator = None
