"""Data position as a global sample offset, and a sampler that resumes from it.

A checkpoint records how many samples *all ranks together* consumed
(``samples_seen``), not per-rank iterator positions.  The sampler walks one
global order per epoch (a seeded permutation, the same on every rank) and
deals it out round-robin: from offset ``o``, rank ``r`` of ``w`` takes the
samples at positions ``o + r``, ``o + r + w``, ...  After a restart at any
world size, starting every rank at the saved offset continues the same
global order, so no sample is skipped or repeated.

The training loop advances the position by the global batch it consumed
(prefetching loaders read ahead, so the loop, not the sampler, keeps count)::

    samples_seen += batch_size * world_size
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ElasticSampler(Sampler[int]):
    """Indices for one rank from a global offset; resumable on any world size.

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

    def global_order(self, epoch: int) -> list[int]:
        """The order every rank agrees on for ``epoch``."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def global_index(self, position: int) -> int:
        """Dataset index at global position ``position`` (across epochs)."""
        epoch, within = divmod(position, self.dataset_len)
        return self.global_order(epoch)[within]

    def __iter__(self) -> Iterator[int]:
        """This rank's indices from ``samples_seen`` on, crossing epochs, without end.

        The training loop decides when to stop (after a number of steps);
        the global stream of positions is consumed exactly once whatever the
        world size was when each part of it was read.
        """
        position = self.samples_seen + self.rank
        epoch = -1
        order: list[int] = []
        while True:
            e, within = divmod(position, self.dataset_len)
            if e != epoch:
                order, epoch = self.global_order(e), e
            yield order[within]
            position += self.world_size

    def advance(self, samples: int) -> None:
        """Move the global offset forward by ``samples`` (all ranks' consumption)."""
        self.samples_seen += samples
