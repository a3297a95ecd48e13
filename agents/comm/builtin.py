"""torch's own comm hooks (fp16, bf16, PowerSGD, post-local SGD) behind the ringmaster handle.

Each class here has the same surface as :class:`~agents.comm.gradient_hook.GradientHook`
(``register``, ``after_optimizer_step``, ``state_dict``, ``load_state_dict``,
``metrics``), so the worker runtime treats every kind of hook alike.

PowerSGD keys its error-feedback and warm-start matrices by bucket index,
which is only safe because it starts compressing after DDP's bucket rebuild.
A process restored from a checkpoint rebuilds its buckets again, so
:class:`PowerSGDHook` saves those tensors by bucket *signature* (parameter
names) and installs them when a bucket with the same signature arrives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local_sgd
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from agents.comm.api import CommMetrics, HookStateError


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    module = getattr(model, "module", model)
    return {id(p): name for name, p in module.named_parameters()}


class _TorchHookBase:
    """Step counting, metrics and the state header shared by torch's hooks."""

    kind = "base"

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.metrics = CommMetrics()
        self.step = 0

    def _count(self, bucket: dist.GradBucket, wire_bytes: int, compressed: bool) -> None:
        self.metrics.add(bucket.buffer().numel(), wire_bytes, compressed=compressed)
        if bucket.is_last():
            self.step += 1
            self.metrics.end_step(self.step)

    def after_optimizer_step(self, model: torch.nn.Module) -> None:
        """Nothing to do after the optimizer step (local SGD overrides this)."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise HookStateError(
                f"checkpoint holds {state.get('kind')!r} hook state but this job uses {self.kind!r}"
            )
        self.step = int(state.get("step", 0))


def _half_entry(state, bucket):
    # Unannotated: DDP checks hook annotations against real classes at registration.
    return state.on_bucket(bucket)


class HalfPrecisionHook(_TorchHookBase):
    """torch's fp16 or bf16 compress hook: cast, all-reduce, cast back.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        process_group: group to average over (default: the world).
    """

    def __init__(self, dtype: torch.dtype, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(process_group)
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.kind = "fp16" if dtype == torch.float16 else "bf16"

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register on a DDP model.

        torch refuses its bf16 hook by name unless NCCL is present, so both
        dtypes go through a thin entry point that calls torch's hook.
        """
        ddp.register_comm_hook(self, _half_entry)

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self._count(bucket, 2 * bucket.buffer().numel(), compressed=True)
        group: Any = self.process_group
        if self.dtype == torch.float16:
            return default_hooks.fp16_compress_hook(group, bucket)
        return default_hooks.bf16_compress_hook(group, bucket)


def _powersgd_entry(state, bucket):
    return state.on_bucket(bucket)


class PowerSGDHook(_TorchHookBase):
    """torch's PowerSGD hook with checkpointable, re-bucketing-proof state.

    PowerSGD keeps, per bucket index, a flat error tensor in bucket order and
    flat P and Q factor memories for the tensors it compresses.  This class
    splits them into per-parameter pieces when a bucket index changes hands
    and when saving, keyed by the bucket's parameter set, and reassembles
    them in the order of whichever bucket holds that set next.  Compression
    is per tensor, so a restored process whose first iteration sees the same
    bucket in another order produces the same gradients.

    Args:
        model: the module (or DDP wrapper) whose parameter names key saved state.
        rank: matrix approximation rank.
        start_iter: first compressed iteration (at least 2, after DDP's bucket rebuild).
        min_compression_rate: tensors compressing less than this go dense.
        warm_start: reuse the previous step's factors.
        process_group: group to average over (default: the world).
        seed: seed of PowerSGD's random factor initialisation.
    """

    kind = "powersgd"

    def __init__(
        self,
        model: torch.nn.Module,
        rank: int = 1,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(process_group)
        self._names = _param_names(model)
        self.state = powerSGD_hook.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=True,
            warm_start=warm_start,
            random_seed=seed,
        )
        self._layout: dict[int, list[tuple[str, torch.Size]]] = {}
        self._stash: dict[str, dict[str, dict[str, torch.Tensor]]] = {}

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(self, _powersgd_entry)

    def _tables(self) -> dict[str, dict[int, torch.Tensor]]:
        s = self.state
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def _segments(self, layout: list[tuple[str, torch.Size]]) -> dict[str, list[tuple[str, int]]]:
        """Per table, the (parameter, length) runs in PowerSGD's flat order."""
        rank = self.state.matrix_approximation_rank
        error = [(name, int(torch.Size(shape).numel())) for name, shape in layout]
        by_shape: dict[tuple[int, int], list[tuple[str, int]]] = {}
        for name, shape in layout:
            numel = int(torch.Size(shape).numel())
            n = int(shape[0]) if len(shape) else 1
            m = numel // max(1, n)
            r = min(n, m, rank)
            compress, _, _ = powerSGD_hook._should_compress(
                n, m, r, self.state.min_compression_rate
            )
            if compress:
                by_shape.setdefault((n, m), []).append((name, r))
        p: list[tuple[str, int]] = []
        q: list[tuple[str, int]] = []
        for (n, m), members in by_shape.items():
            for name, r in members:
                p.append((name, n * r))
                q.append((name, m * r))
        return {"error": error, "p": p, "q": q}

    @staticmethod
    def _composition(layout: list[tuple[str, torch.Size]]) -> str:
        return "\n".join(sorted(name for name, _ in layout))

    def _split(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        layout = self._layout[index]
        pieces: dict[str, dict[str, torch.Tensor]] = {name: {} for name, _ in layout}
        segments = self._segments(layout)
        for table_name, table in self._tables().items():
            flat = table.get(index)
            if flat is None:
                continue
            offset = 0
            for name, length in segments[table_name]:
                pieces[name][table_name] = flat[offset : offset + length].clone()
                offset += length
        return pieces

    def _assemble(
        self, layout: list[tuple[str, torch.Size]], pieces: Mapping[str, Mapping[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for table_name, runs in self._segments(layout).items():
            parts = [pieces.get(name, {}).get(table_name) for name, _ in runs]
            if runs and all(t is not None for t in parts):
                out[table_name] = torch.cat([t for t in parts if t is not None])
        return out

    def _remap(self, bucket: dist.GradBucket) -> None:
        index = bucket.index()
        layout = [
            (self._names.get(id(p), f"#{i}"), p.shape) for i, p in enumerate(bucket.parameters())
        ]
        old = self._layout.get(index)
        if old == layout:
            return
        tables = self._tables()
        if old is not None and any(index in t for t in tables.values()):
            self._stash[self._composition(old)] = self._split(index)
        for t in tables.values():
            t.pop(index, None)
        self._layout[index] = layout
        pieces = self._stash.pop(self._composition(layout), None)
        if pieces:
            for table_name, flat in self._assemble(layout, pieces).items():
                tables[table_name][index] = flat

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self._remap(bucket)
        before = self.state.total_numel_after_compression
        compressing = self.state.iter >= self.state.start_powerSGD_iter
        # torch's hook chains collectives whose callbacks block on further
        # collectives; with several buckets in flight on gloo's small thread
        # pool that can deadlock, so each bucket completes before the next.
        result = powerSGD_hook.powerSGD_hook(self.state, bucket).wait()
        sent = self.state.total_numel_after_compression - before
        wire = 4 * (sent if compressing else bucket.buffer().numel())
        self._count(bucket, wire, compressed=compressing)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(result)
        return fut

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        tables = {
            comp: {n: dict(parts) for n, parts in pieces.items()}
            for comp, pieces in self._stash.items()
        }
        for index, layout in self._layout.items():
            if any(index in t for t in self._tables().values()):
                tables[self._composition(layout)] = self._split(index)
        import numpy as np  # PowerSGD's own RNG is numpy's; nothing else here needs it

        algo, keys, pos, has_gauss, cached = self.state.rng.get_state()
        out.update(
            iter=self.state.iter,
            tables=tables,
            rng={
                "algo": str(algo),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            },
            numel_before=self.state.total_numel_before_compression,
            numel_after=self.state.total_numel_after_compression,
        )
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.state.iter = int(state["iter"])
        for table in self._tables().values():
            table.clear()
        self._layout.clear()
        self._stash = {
            str(comp): {
                str(n): {str(k): v.clone() for k, v in parts.items()} for n, parts in pieces.items()
            }
            for comp, pieces in state["tables"].items()
        }
        import numpy as np

        rng = state["rng"]
        self.state.rng.set_state(
            (
                rng["algo"],
                rng["keys"].numpy().astype(np.uint32),
                rng["pos"],
                rng["has_gauss"],
                rng["cached"],
            )
        )
        self.state.total_numel_before_compression = int(state.get("numel_before", 0))
        self.state.total_numel_after_compression = int(state.get("numel_after", 0))


def _local_sgd_entry(state, bucket):
    return state.on_bucket(bucket)


class LocalSGDHook(_TorchHookBase):
    """torch's post-local-SGD hook plus periodic parameter averaging.

    For ``start_iter`` steps gradients are all-reduced globally; after that
    each node trains on its own (gradients averaged inside the node when it
    runs several ranks) and parameters are averaged over all ranks every
    ``period`` steps.  The worker must call :meth:`after_optimizer_step`.

    Args:
        period: steps between parameter averages.
        start_iter: steps of global gradient averaging first.
        intra_group: the node's group (``None``: no intra-node gradient averaging).
        process_group: group to average over (default: the world).
    """

    kind = "localsgd"

    def __init__(
        self,
        period: int,
        start_iter: int,
        intra_group: dist.ProcessGroup | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(process_group)
        self.state = local_sgd.PostLocalSGDState(
            process_group=process_group,
            subgroup=intra_group,
            start_localSGD_iter=start_iter,
            post_local_gradient_allreduce=intra_group is not None,
        )
        self.averager = PeriodicModelAverager(
            period=period, warmup_steps=start_iter, process_group=process_group
        )

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(self, _local_sgd_entry)

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        n = bucket.buffer().numel()
        local = self.state.iter >= self.state.start_localSGD_iter
        wire = 0 if local and self.state.subgroup is None else 4 * n
        self._count(bucket, wire, compressed=local)
        return local_sgd.post_localSGD_hook(self.state, bucket)

    def after_optimizer_step(self, model: torch.nn.Module) -> None:
        """Average parameters over all ranks when the period comes round."""
        self.averager.average_parameters(list(model.parameters()))

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out.update(iter=self.state.iter, averager_step=self.averager.step)
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.state.iter = int(state["iter"])
        self.averager.step = int(state["averager_step"])
