"""Top-k sparsification with error feedback, DGC momentum correction and warm-up.

Each rank sends only the ``k`` largest-magnitude elements of its corrected
gradient, as values plus indices in one float32 payload (indices are int32
bit patterns), and keeps the rest as a residual added to the next step's
gradient (error feedback).  With ``momentum > 0`` the hook applies momentum
itself, before sparsification, as Deep Gradient Compression does (Lin et al.,
ICLR 2018): ``u = m·u + g``, ``v = v + u``, send top-k of ``v``, and clear both
``u`` and ``v`` where sent (momentum factor masking).  The optimizer must then
run without momentum of its own.  During warm-up the density falls
exponentially from dense to ``ratio``; while the sparse exchange would move
more bytes than a dense ring all-reduce the bucket is sent dense.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from agents.comm.api import Encoded

#: Bytes per sent element: one float32 value and one int32 index.
_BYTES_PER_ELEMENT = 8


class TopKCompressor:
    """Top-k of the error-corrected (and momentum-corrected) gradient.

    Args:
        ratio: fraction of elements sent once warm-up is over, in (0, 1].
        momentum: DGC momentum (0 disables momentum correction: plain error feedback).
        warmup_steps: steps over which the density falls from 1 to ``ratio``.
    """

    payload_dtype = torch.float32

    def __init__(self, ratio: float, momentum: float = 0.0, warmup_steps: int = 0) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio:g}")
        self.ratio = ratio
        self.momentum = momentum
        self.warmup_steps = warmup_steps
        self.buffer_names: tuple[str, ...] = (
            ("momentum", "residual") if momentum > 0 else ("residual",)
        )

    def density(self, step: int) -> float:
        """Fraction of elements sent at ``step`` (exponential warm-up schedule)."""
        if step >= self.warmup_steps:
            return self.ratio
        return float(self.ratio ** ((step + 1) / (self.warmup_steps + 1)))

    def k(self, step: int, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.density(step) * numel)))

    def active(self, step: int, numel: int, world_size: int) -> bool:
        # All-gather moves (W-1)·payload per rank; a ring all-reduce 2(W-1)/W·4n bytes.
        sparse = _BYTES_PER_ELEMENT * self.k(step, numel)
        dense = 2 * 4 * numel / max(1, world_size)
        return sparse < dense

    def _velocity(
        self, grad: torch.Tensor, buffers: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.momentum > 0:
            u = buffers["momentum"].mul(self.momentum).add_(grad)
            return buffers["residual"] + u, u
        return buffers["residual"] + grad, None

    def encode(
        self,
        grad: torch.Tensor,
        buffers: Mapping[str, torch.Tensor],
        step: int,
        generator: torch.Generator,
    ) -> Encoded:
        corrected, u = self._velocity(grad, buffers)
        k = self.k(step, corrected.numel())
        indices = torch.topk(corrected.abs(), k, sorted=False).indices
        values = corrected[indices]
        payload = torch.cat([values, indices.to(torch.int32).view(torch.float32)])
        residual = corrected.clone()
        residual[indices] = 0.0
        commit = {"residual": residual}
        flush = {"residual": torch.zeros_like(corrected)}
        if u is not None:
            masked = u.clone()
            masked[indices] = 0.0
            commit["momentum"] = masked
            flush["momentum"] = u
        return Encoded(payload, corrected, commit, flush)

    def dense(
        self, grad: torch.Tensor, buffers: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        corrected, u = self._velocity(grad, buffers)
        after = {"residual": torch.zeros_like(corrected)}
        if u is not None:
            after["momentum"] = u
        return corrected, after

    def decode_sum(self, gathered: torch.Tensor, numel: int, step: int) -> torch.Tensor:
        k = gathered.shape[1] // 2
        values = gathered[:, :k].reshape(-1)
        indices = gathered[:, k:].contiguous().view(torch.int32).reshape(-1).to(torch.int64)
        out = torch.zeros(numel, dtype=torch.float32)
        out.index_add_(0, indices, values)
        return out
