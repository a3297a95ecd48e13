"""examples/train_tiny.py's final parameters, computed in this process.

The chaos tests compare a run with faults against a fault-free run of the
same job.  For examples/train_tiny.py that run's result is known without
running it: every step is one global batch split across the ranks, each rank
takes its share's gradient, and DDP averages them (a mean over two ranks is
exact in floating point, whatever the order).  Computing it here costs a
fraction of a second instead of a whole job (10 to 35 s each).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from examples.train_tiny import CLASSES, FEATURES, GLOBAL_BATCH, batch, dataset

__all__ = ["tiny_final"]


@functools.lru_cache(maxsize=8)
def _final(steps: int, world: int) -> tuple[tuple[str, torch.Tensor], ...]:
    with torch.random.fork_rng():  # the seed below leaves the test process's RNG as it was
        return _train(steps, world)


def _train(steps: int, world: int) -> tuple[tuple[str, torch.Tensor], ...]:
    x, y = dataset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = list(model.parameters())
    for step in range(steps):
        grads = []
        for rank in range(world):
            model.zero_grad()
            xb, yb = batch(step, rank, world, x, y)
            loss = F.cross_entropy(model(xb), yb, reduction="sum") * world / GLOBAL_BATCH
            loss.backward()
            grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in grads) / world  # type: ignore[assignment]
        opt.step()
    return tuple((k, v.detach().clone()) for k, v in model.state_dict().items())


def tiny_final(steps: int, world: int = 2) -> dict[str, torch.Tensor]:
    """The parameters examples/train_tiny.py saves after ``steps`` steps on ``world``
    ranks with no fault (a new copy on each call)."""
    return {k: v.clone() for k, v in _final(steps, world)}
