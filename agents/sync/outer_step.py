"""The outer step of DiLoCo: pseudo-gradients, their average, the outer optimizer (pure).

Runs in the training process; no collective is called here.  Per fragment
of the model, the *anchor* is the flat float32 copy of its parameters, in
host memory, as they were after the last outer step (the sites' common,
global value).  On a GPU worker the outer state thus costs no device memory;
a sync copies the fragment out and back (out twice where alpha is above 0)
once per ``inner_steps`` steps.  A site's *pseudo-gradient* is the anchor
minus its parameters now: what its inner steps moved, with the sign of a
gradient.  The sites' average goes through SGD with (Nesterov) momentum on
the anchor::

    buf    = momentum * buf + g
    update = g + momentum * buf     (nesterov)      or  buf  (sgd)
    anchor = anchor - lr * update

and the new anchor is the global fragment.  Each site then merges it with
its own (Streaming DiLoCo, Douillard et al. 2025, section 2.3)::

    params = alpha * local + (1 - alpha) * anchor

where ``local`` is the site's own fragment now: with a delay, the inner steps
taken while the average travelled are in it.  ``alpha`` 0 (DiLoCo's) replaces
the site's fragment with the global one; the anchor, where the next
pseudo-gradient counts from, is the global fragment either way.  Each
fragment has its own momentum buffer: fragments sync at different steps, and
their outer steps never mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orchestrator.spec.sync import OuterOptimizerName, OuterOptimizerSpec

__all__ = [
    "OuterOptimizer",
    "average",
    "flatten",
    "merge_into",
    "pseudo_gradient",
    "rebase",
    "write_back",
]


def flatten(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters as one new float32 vector in host memory, in order (each
    copied straight in from its device and dtype: no copy of the whole on a GPU)."""
    out = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
    offset = 0
    for p in params:
        n = p.numel()
        out[offset : offset + n].copy_(p.detach().reshape(-1))
        offset += n
    return out


def write_back(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``params`` (in order), each in its own dtype."""
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def pseudo_gradient(anchor: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The anchor minus the parameters now (a new tensor)."""
    return anchor - flatten(params)


def average(contributions: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """The weighted mean of ``(weight, pseudo-gradient)`` pairs, summed in the order given.

    Every site sums the same contributions in the same order, so every site
    gets the same bits.  A weight of 0 (a site that joined after the sync
    started) adds nothing.

    Raises:
        ValueError: the weights sum to 0.
    """
    total = sum(w for w, _ in contributions)
    if total <= 0:
        raise ValueError("no site contributed a pseudo-gradient")
    out = torch.zeros_like(contributions[0][1], dtype=torch.float32)
    for w, g in contributions:
        if w:
            out.add_(g.float(), alpha=w)
    return out.div_(total)


def merge_into(params: Sequence[torch.Tensor], global_: torch.Tensor, alpha: float) -> None:
    """``params`` (a site's fragment now) become ``alpha * params + (1 - alpha) *
    global_`` (the new global fragment), each in its own dtype; with ``alpha`` 0 they
    become ``global_``.  Every rank of a site computes it from the same numbers, so
    the site's replicas stay alike."""
    write_back(params, torch.lerp(global_, flatten(params), alpha) if alpha else global_)


def rebase(params: Sequence[torch.Tensor], old: torch.Tensor, new: torch.Tensor) -> None:
    """``params`` (a site's fragment now) keep what they moved from the ``old`` anchor, on
    top of the ``new`` one: ``params - old + new``.  A site left out of a round (it came
    after the others went ahead) takes the round's outer step this way: its own inner
    steps are in none of it, so it keeps them, and its next pseudo-gradient (the new
    anchor minus its parameters) carries them to the next round it takes part in."""
    write_back(params, flatten(params).sub_(old).add_(new))


@dataclass(frozen=True)
class OuterOptimizer:
    """SGD with momentum (Nesterov or plain) on a fragment's anchor."""

    lr: float
    momentum: float
    nesterov: bool

    @classmethod
    def of_spec(cls, spec: OuterOptimizerSpec) -> OuterOptimizer:
        return cls(spec.lr, spec.momentum, spec.name is OuterOptimizerName.NESTEROV)

    def step(self, anchor: torch.Tensor, buf: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply ``grad`` (the sites' average pseudo-gradient) to ``anchor``, in place."""
        if self.momentum:
            buf.mul_(self.momentum).add_(grad)
            update = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        else:
            update = grad
        anchor.sub_(update, alpha=self.lr)
