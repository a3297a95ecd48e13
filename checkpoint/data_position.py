"""Where a job is in its data: one global stream of sample positions, dealt round-robin.

The one sample-position convention of ringmaster, shared by
:class:`ElasticSampler` (here: a ``Sampler`` for a plain ``DataLoader``) and
:class:`agents.runtime.data.ElasticLoader` (the worker runtime's loader,
addressed by step):

* **one global stream.**  Position ``p`` is the sample
  ``perm(p // N)[p % N]``, ``N`` the dataset's length and ``perm(e)`` a
  permutation seeded with ``seed + e``, the same on every rank
  (:class:`GlobalOrder`).  A checkpoint records how many positions *all
  ranks together* consumed (``samples_seen``), not per-rank iterator
  positions;
* **dealt round-robin.**  From the start ``o`` of a stretch of the stream,
  rank ``r`` of ``w`` takes the positions ``o + r``, ``o + r + w``, ...
  (as torch's ``DistributedSampler`` deals its indices;
  :func:`rank_positions`).  The sampler's stretch starts at
  ``samples_seen`` and has no end; the loader's is one step's global batch,
  ``[s * B, (s + 1) * B)``.

After a restart at any world size, starting every rank at the saved offset
continues the same global stream, so no sample is skipped or repeated.

With the sampler the training loop advances the position by the global
batch it consumed (prefetching loaders read ahead, so the loop, not the
sampler, keeps count)::

    samples_seen += batch_size * world_size
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

__all__ = ["ElasticSampler", "GlobalOrder", "rank_positions", "share_size"]


def rank_positions(start: int, stop: int, rank: int, world_size: int) -> range:
    """The positions of ``[start, stop)`` that ``rank`` of ``world_size`` takes (round-robin).

    When ``world_size`` does not divide the stretch, the first ranks take one
    position more.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    return range(start + rank, stop, world_size)


def share_size(count: int, rank: int, world_size: int) -> int:
    """How many of ``count`` consecutive positions ``rank`` of ``world_size`` takes."""
    return len(rank_positions(0, count, rank, world_size))


class GlobalOrder:
    """The endless stream of dataset indices: one seeded permutation per epoch.

    Args:
        length: samples in the dataset.
        seed: base seed; epoch ``e`` is permuted with ``seed + e``.
        shuffle: False keeps every epoch in dataset order.

    Raises:
        ValueError: the dataset is empty.
    """

    def __init__(self, length: int, seed: int = 0, shuffle: bool = True) -> None:
        if length < 1:
            raise ValueError(f"the dataset is empty (length {length}); give it samples")
        self.length = length
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm = torch.arange(length)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of ``epoch`` as a tensor of indices (the last one asked for is kept)."""
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.length, generator=g)
            else:
                self._perm = torch.arange(self.length)
            self._epoch = epoch
        return self._perm

    def index(self, position: int) -> int:
        """The dataset index at global position ``position``."""
        epoch, within = divmod(position, self.length)
        return int(self.permutation(epoch)[within])

    def indices(self, start: int, stop: int, step: int = 1) -> list[int]:
        """Dataset indices at the global positions ``range(start, stop, step)``, across epochs."""
        out: list[int] = []
        position = start
        while position < stop:
            epoch, within = divmod(position, self.length)
            first = epoch * self.length
            end = min(stop, first + self.length)  # this epoch's part of the range
            out += self.permutation(epoch)[within : end - first : step].tolist()
            position += len(range(position, end, step)) * step
        return out


class ElasticSampler(Sampler[int]):
    """Indices for one rank from a global offset; resumable on any world size.

    Follows the module's convention: the global stream from ``samples_seen``
    on, dealt round-robin.

    Args:
        dataset_len: number of samples in the dataset.
        rank: this rank.
        world_size: number of data-parallel ranks.
        samples_seen: global samples consumed so far (across epochs).
        shuffle: permute each epoch with ``seed + epoch``.
        seed: base seed, equal on all ranks.
    """

    def __init__(
        self,
        dataset_len: int,
        rank: int,
        world_size: int,
        samples_seen: int = 0,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be at least 1, got {dataset_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if samples_seen < 0:
            raise ValueError(f"samples_seen must be 0 or more, got {samples_seen}")
        self.dataset_len = dataset_len
        self.rank = rank
        self.world_size = world_size
        self.samples_seen = samples_seen
        self.shuffle = shuffle
        self.seed = seed

    @property
    def epoch(self) -> int:
        """Epoch the current offset falls in."""
        return self.samples_seen // self.dataset_len

    def _order(self) -> GlobalOrder:
        return GlobalOrder(self.dataset_len, self.seed, self.shuffle)

    def global_order(self, epoch: int) -> list[int]:
        """The order every rank agrees on for ``epoch``."""
        return self._order().permutation(epoch).tolist()

    def global_index(self, position: int) -> int:
        """Dataset index at global position ``position`` (across epochs)."""
        return self._order().index(position)

    def __iter__(self) -> Iterator[int]:
        """This rank's indices from ``samples_seen`` on, crossing epochs, without end.

        The training loop decides when to stop (after a number of steps);
        the global stream of positions is consumed exactly once whatever the
        world size was when each part of it was read.
        """
        order = self._order()
        position = self.samples_seen + self.rank  # rank_positions(samples_seen, ∞, ...)
        epoch, listed = -1, []
        while True:
            e, within = divmod(position, self.dataset_len)
            if e != epoch:
                listed, epoch = order.permutation(e).tolist(), e
            yield listed[within]
            position += self.world_size

    def advance(self, samples: int) -> None:
        """Move the global offset forward by ``samples`` (all ranks' consumption)."""
        self.samples_seen += samples
