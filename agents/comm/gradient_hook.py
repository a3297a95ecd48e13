"""The DDP comm hook for dense, hierarchical and compressed (top-k, QSGD) averaging.

:class:`GradientHook` is both the hook's state object and its entry point
(:meth:`GradientHook.register`).  Per bucket it picks one route:

* flat dense: a plain all-reduce (``compression: none``);
* hierarchical dense: :func:`agents.comm.hierarchical.hierarchical_average`;
* compressed: a :class:`~agents.comm.compressed.CompressedExchange` over all
  ranks, or, with ``inter_node_only``, only over the inter-node stage of the
  hierarchical exchange.

Buffers are kept per parameter (:mod:`agents.comm.buffers`), so they survive
DDP's bucket rebuild after the first iteration and load into any bucketing.
The state (step, buffers, norm history, random generator) is per rank and
goes into checkpoints through :meth:`state_dict` / :meth:`load_state_dict`.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from agents.comm.api import CommError, CommMetrics, Compressor, HookStateError
from agents.comm.buffers import BufferStore, Signature
from agents.comm.compressed import DEFAULT_COSINE_EVERY, CompressedExchange
from agents.comm.hierarchical import (
    HierarchyGroups,
    hierarchical_average,
    shard_length,
    wire_bytes,
)
from agents.comm.safety import SafetyPolicy

#: Format version of :meth:`GradientHook.state_dict`.
STATE_VERSION = 1


def _ddp_entry(state, bucket):
    # Left unannotated on purpose: DDP compares the annotations of a hook with
    # the real classes at registration, and postponed annotations are strings.
    return state.on_bucket(bucket)


class GradientHook:
    """A DDP comm hook averaging gradients dense, hierarchically or compressed.

    Args:
        model: the module whose parameters DDP reduces (or the DDP wrapper);
            its parameter names key the per-parameter buffers.
        compressor: ``None`` for dense averaging.
        policy: safety knobs of the compressed exchange.
        groups: hierarchy groups; ``None`` for a flat exchange.
        inter_node_only: compress only the inter-node stage (needs ``groups``).
        process_group: group of the flat exchange (default: the world).
        seed: seed of the per-rank random generator (stochastic rounding).
        cosine_every: sample the compression cosine every this many steps.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        compressor: Compressor | None = None,
        policy: SafetyPolicy | None = None,
        groups: HierarchyGroups | None = None,
        inter_node_only: bool = False,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        cosine_every: int = DEFAULT_COSINE_EVERY,
    ) -> None:
        if inter_node_only and (groups is None or compressor is None):
            raise CommError("inter_node_only needs both a compressor and hierarchy groups")
        module = getattr(model, "module", model)
        named = list(module.named_parameters())
        self._names = {id(p): name for name, p in named}
        self._position = {name: i for i, (name, _) in enumerate(named)}
        self.compressor = compressor
        self.groups = groups
        self.inter_node_only = inter_node_only
        self.process_group = process_group
        self.metrics = CommMetrics()
        self.step = 0
        self.policy = policy or SafetyPolicy()
        self.store = BufferStore(compressor.buffer_names if compressor else ())
        inter_group = groups.inter if (groups is not None and inter_node_only) else None
        self.exchange = (
            CompressedExchange(
                compressor,
                self.policy,
                inter_group if inter_node_only else process_group,
                self.metrics,
                cosine_every,
            )
            if compressor is not None
            else None
        )
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.generator = torch.Generator().manual_seed(seed * 100_003 + rank)

    # ------------------------------------------------------------------ DDP side

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register this hook on a DDP model (once, before the first forward)."""
        ddp.register_comm_hook(self, _ddp_entry)

    def after_optimizer_step(self, model: torch.nn.Module) -> None:
        """Nothing to do after the optimizer step for this hook (see local SGD)."""

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average one bucket; called by DDP from the backward pass.

        The bucket is processed in canonical parameter order (the model's
        registration order), so the result depends on which parameters share
        a bucket, not on the order DDP put them in: the first iteration of a
        restored process (DDP's initial layout) matches the rebuilt layout of
        the uninterrupted run.
        """
        flat = bucket.buffer()
        if flat.dtype != torch.float32:
            raise CommError(f"gradient buckets must be float32, got {flat.dtype}")
        params = bucket.parameters()
        numels = [p.numel() for p in params]
        if sum(numels) != flat.numel():
            raise CommError(
                f"bucket {bucket.index()} holds {flat.numel()} elements but its "
                f"parameters have {sum(numels)}"
            )
        names = [self._names.get(id(p), f"#{i}") for i, p in enumerate(params)]
        perm = sorted(range(len(params)), key=lambda i: (self._position.get(names[i], -1), i))
        signature = tuple(names[i] for i in perm)
        if perm == list(range(len(params))):
            result = self._average(flat, signature, numels)
        else:
            pieces = flat.split(numels)
            canonical = torch.cat([pieces[i] for i in perm])
            averaged = self._average(canonical, signature, [numels[i] for i in perm])
            back = averaged.split([numels[i] for i in perm])
            result = torch.empty_like(flat)
            out = result.split(numels)
            for j, i in enumerate(perm):
                out[i].copy_(back[j])
        if bucket.is_last():
            self.step += 1
            self.metrics.end_step(self.step)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(result)
        return fut

    @staticmethod
    def _key(signature: Signature, part: int = 0) -> str:
        digest = zlib.crc32("\n".join(signature).encode())
        return f"{len(signature)}:{digest:08x}:{part}"

    def _average(self, flat: torch.Tensor, signature: Signature, numels: list[int]) -> torch.Tensor:
        groups = self.groups
        if self.exchange is None:
            if groups is not None:
                self.metrics.add(flat.numel(), wire_bytes(flat.numel(), 4, groups), False)
                return hierarchical_average(flat, groups)
            out = flat.clone()
            dist.all_reduce(out, group=self.process_group)
            self.metrics.add(out.numel(), 4 * out.numel(), compressed=False)
            return out.div_(dist.get_world_size(self.process_group))
        exchange = self.exchange
        if groups is not None and self.inter_node_only:
            chunk = shard_length(flat.numel(), groups.local_world_size)
            buffers = self.store.get(signature, numels, length=chunk * groups.local_world_size)
            lo = groups.local_rank * chunk

            def inter(shard: torch.Tensor, index: int) -> torch.Tensor:
                views = {k: v[lo : lo + chunk] for k, v in buffers.items()}
                key = self._key(signature, index)
                return exchange.average(shard, views, key, self.step, self.generator)

            intra = wire_bytes(flat.numel(), 4, groups) - (4 * chunk if groups.inter else 0)
            self.metrics.add_bytes(intra)
            return hierarchical_average(flat, groups, inter)
        buffers = self.store.get(signature, numels)
        if groups is not None and self.policy.dense_step(self.step):
            # Dense steps of a compressed hierarchical job still go node-first.
            send, after = exchange.compressor.dense(flat, buffers)
            result = hierarchical_average(send, groups)
            self.metrics.add(flat.numel(), wire_bytes(flat.numel(), 4, groups), False)
            if bool(torch.isfinite(result).all()):
                for k, v in after.items():
                    buffers[k].copy_(v)
            return result
        return exchange.average(flat, buffers, self._key(signature), self.step, self.generator)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's hook state: step, per-parameter buffers, norm history, RNG."""
        return {
            "version": STATE_VERSION,
            "kind": type(self.compressor).__name__ if self.compressor else "dense",
            "step": self.step,
            "buffers": self.store.state_dict(),
            "exchange": self.exchange.state_dict() if self.exchange else {},
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (from this rank's checkpoint).

        Raises:
            HookStateError: the state was saved by a different kind of hook.
        """
        kind = type(self.compressor).__name__ if self.compressor else "dense"
        if state.get("kind") != kind:
            raise HookStateError(
                f"checkpoint holds {state.get('kind')!r} hook state but this job uses {kind!r}"
            )
        self.step = int(state["step"])
        self.metrics.current.step = self.step
        self.store.load_state_dict(state["buffers"])
        if self.exchange is not None:
            self.exchange.load_state_dict(state.get("exchange", {}))
        self.generator.set_state(state["generator"])
