"""One compressed averaging exchange: error feedback, safety net and metrics around a compressor.

:class:`CompressedExchange` averages a 1-D float32 tensor over a process
group with a :class:`~agents.comm.api.Compressor`.  In the common case it
costs a single all-gather: every rank's payload carries a trailing status
word (its gradient norm), from which all ranks reach the same verdict
(:mod:`agents.comm.safety`).  Dense steps (warm-up, periodic sync, buckets
too small to gain) are one all-reduce with the norm appended.  Buffers are
only changed once the verdict is known, so a rejected payload leaves no trace
in the error feedback.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from agents.comm import collectives
from agents.comm.api import CommMetrics, Compressor
from agents.comm.safety import NormTracker, SafetyPolicy, Verdict

#: Cosine similarity is sampled every this many steps by default (0: never).
DEFAULT_COSINE_EVERY = 10


def _status_word(norm: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([norm], dtype=torch.float32).view(dtype)


def _commit(buffers: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    for name, value in new.items():
        buffers[name].copy_(value)


class CompressedExchange:
    """Average tensors over ``group`` with a compressor, error feedback and fallbacks.

    Args:
        compressor: the encoding.
        policy: warm-up, periodic dense sync and exploding-gradient limits.
        group: process group to average over (``None``: the default group).
        metrics: where to record bytes sent and compression outcomes.
        cosine_every: sample the local compression cosine every this many steps.
    """

    def __init__(
        self,
        compressor: Compressor,
        policy: SafetyPolicy,
        group: dist.ProcessGroup | None,
        metrics: CommMetrics,
        cosine_every: int = DEFAULT_COSINE_EVERY,
    ) -> None:
        self.compressor = compressor
        self.policy = policy
        self.group = group
        self.metrics = metrics
        self.cosine_every = cosine_every
        self.tracker = NormTracker()

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def average(
        self,
        grad: torch.Tensor,
        buffers: Mapping[str, torch.Tensor],
        key: str,
        step: int,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """The group average of ``grad`` (1-D float32), compressed when it pays.

        Args:
            grad: this rank's contribution (not modified).
            buffers: this tensor's compressor buffers (updated in place).
            key: stable name of the tensor (bucket signature) for the norm history.
            step: hook iteration.
            generator: random source of stochastic compressors.
        """
        n = grad.numel()
        world = self.world_size
        if self.policy.dense_step(step) or not self.compressor.active(step, n, world):
            return self._dense(grad, buffers, key)
        return self._compressed(grad, buffers, key, step, generator)

    def _dense(
        self, grad: torch.Tensor, buffers: Mapping[str, torch.Tensor], key: str
    ) -> torch.Tensor:
        send, after = self.compressor.dense(grad, buffers)
        norm = float(grad.norm())
        out = torch.cat([send, torch.tensor([norm], dtype=torch.float32)])
        dist.all_reduce(out, group=self.group)
        out.div_(self.world_size)
        mean_norm = float(out[-1])
        if math.isfinite(mean_norm):
            _commit(buffers, after)
            self.tracker.observe(key, mean_norm, self.policy)
        self.metrics.add(grad.numel(), 4 * out.numel(), compressed=False)
        return out[:-1]

    def _compressed(
        self,
        grad: torch.Tensor,
        buffers: Mapping[str, torch.Tensor],
        key: str,
        step: int,
        generator: torch.Generator,
    ) -> torch.Tensor:
        n = grad.numel()
        world = self.world_size
        norm = float(grad.norm())
        finite = math.isfinite(norm)
        # A rank with NaN/Inf still sends a well-formed payload; its status word says it is bad.
        encoded = self.compressor.encode(
            grad if finite else torch.zeros_like(grad), buffers, step, generator
        )
        status = _status_word(norm, self.compressor.payload_dtype)
        payload = torch.cat([encoded.payload, status])
        flat = torch.empty(world * payload.numel(), dtype=payload.dtype)
        collectives.all_gather_single(flat, payload, group=self.group)
        gathered = flat.view(world, payload.numel())
        width = status.numel()
        norms = gathered[:, -width:].clone().view(torch.float32).reshape(-1).tolist()
        verdict = self.tracker.verdict(key, norms, self.policy)
        wire = payload.numel() * payload.element_size()
        if verdict is Verdict.USE:
            result = self.compressor.decode_sum(gathered[:, :-width], n, step).div_(world)
            if self.cosine_every and step % self.cosine_every == 0:
                own = self.compressor.decode_sum(encoded.payload[None, :], n, step)
                cos = torch.nn.functional.cosine_similarity(own, encoded.corrected, dim=0)
                self.metrics.current.cosine = float(cos)
            _commit(buffers, encoded.commit)
            self.metrics.add(n, wire, compressed=True)
            return result
        # Fallback: everyone sends its corrected gradient dense.
        send = encoded.corrected if finite else grad.clone()
        dist.all_reduce(send, group=self.group)
        send.div_(world)
        if verdict is Verdict.EXPLODING:
            _commit(buffers, encoded.flush)
        self.metrics.add(n, wire + 4 * n, compressed=False, fallback=True)
        return send

    def state_dict(self) -> dict[str, Any]:
        return {"norms": self.tracker.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.tracker.load_state_dict(state.get("norms", {}))
