"""Worker functions for the checkpoint integration tests (run in gloo processes).

They live in an importable module because ``tests.gloo.run_gloo`` spawns
fresh interpreters that import the function by name.
"""

from __future__ import annotations

import os
import signal
from typing import Any

BATCH = 4
DATASET = 64
STEPS = 3


def build(seed: int) -> tuple[Any, Any, Any]:
    """A tiny model, Adam and a step LR schedule, initialised from ``seed``."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def snapshot(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Plain-Python copy of everything a resume must bring back."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optim: Any = get_optimizer_state_dict(model, optimizer)
    return {
        "model": {k.removeprefix("module."): v.tolist() for k, v in model.state_dict().items()},
        "optim": {
            fqn: {name: t.tolist() for name, t in state.items()}
            for fqn, state in optim["state"].items()
        },
        "lr": [g["lr"] for g in optimizer.param_groups],
        "sched": scheduler.state_dict()["last_epoch"],
    }


def train_and_save(
    rank: int, world: int, url: str, options: dict[str, Any], steps: int = STEPS
) -> dict[str, Any]:
    """Train ``steps`` DDP steps on an elastic sampler and save asynchronously at the last."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from checkpoint import Checkpointer, ElasticSampler, TrainState

    model, optimizer, scheduler = build(seed=0)
    ddp = DistributedDataParallel(model)
    data = torch.randn(DATASET, 6, generator=torch.Generator().manual_seed(7))
    sampler = ElasticSampler(DATASET, rank, world, seed=3)
    it = iter(sampler)
    state = TrainState(
        ddp, optimizer, scheduler, rank_state={"residual": torch.full((4,), 1.0 + rank)}
    )
    ckpt = Checkpointer(url, storage_options=options, keep=5, every_steps=steps)
    consumed: list[int] = []
    handle = None
    for step in range(1, steps + 1):
        idx = [next(it) for _ in range(BATCH)]
        consumed += idx
        loss = ddp(data[idx]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        state.samples_seen += BATCH * world
        handle = ckpt.maybe_save(step, state) or handle
    assert handle is not None and handle.step == steps
    manifest = handle.wait()
    ckpt.close()
    return {
        "state": snapshot(model, optimizer, scheduler),
        "consumed": consumed,
        "objects": [o.path for o in manifest.objects],
        "staging_s": handle.staging_seconds,
    }


def resume(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Restore into a differently initialised model; report state and next samples."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from checkpoint import Checkpointer, ElasticSampler, TrainState

    model, optimizer, scheduler = build(seed=1234)
    # In the test process itself (world size 1) there is no process group to wrap.
    ddp = DistributedDataParallel(model) if dist.is_initialized() else model
    state = TrainState(ddp, optimizer, scheduler, rank_state={"residual": torch.zeros(4)})
    ckpt = Checkpointer(url, storage_options=options, keep=5)
    result = ckpt.restore(state)
    sampler = ElasticSampler(DATASET, rank, world, result.samples_seen, seed=3)
    it = iter(sampler)
    ckpt.close()
    return {
        "state": snapshot(model, optimizer, scheduler),
        "step": result.step,
        "source": result.source.value,
        "samples_seen": state.samples_seen,
        "next": [next(it) for _ in range(BATCH)],
        "rank_state": state.rank_state.get("residual", torch.zeros(1)).tolist(),
        "rank_state_restored": result.rank_state_restored,
    }


class _FaultyFile:
    """Wraps a writable file; on the first write, writes part of it then faults."""

    def __init__(self, raw: Any, fault: str) -> None:
        self._raw = raw
        self._fault = fault

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._raw.write(view[: max(1, view.nbytes // 2)])
        self._raw.flush()
        if self._fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(5, "injected I/O error")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._raw.close()


def faulty_filesystem(url: str, options: dict[str, Any], suffix: str, fault: str) -> Any:
    """The real filesystem of ``url`` whose writes of ``*suffix`` objects fault.

    ``fault`` is ``"kill"`` (SIGKILL this process mid-write) or ``"error"``
    (raise ``OSError`` after writing part of the object).
    """
    from fsspec.core import url_to_fs

    base, _ = url_to_fs(url, **options)

    class Faulty(type(base)):  # type: ignore[misc]
        def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
            f = super()._open(path, mode, *args, **kwargs)
            if "w" in mode and str(path).endswith(suffix):
                return _FaultyFile(f, fault)
            return f

    return Faulty(skip_instance_cache=True, **options)


def save_then_fault(
    rank: int, world: int, url: str, options: dict[str, Any], suffix: str, fault: str
) -> str:
    """Commit step 1, then save step 2 through a faulty filesystem on the last rank."""
    import torch

    from checkpoint import Checkpointer, CheckpointError, TrainState

    model, optimizer, scheduler = build(seed=0)
    state = TrainState(model, optimizer, scheduler)
    Checkpointer(url, storage_options=options, keep=5).save_now(1, state)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    faulty = rank == world - 1
    fs = faulty_filesystem(url, options, suffix, fault) if faulty else None
    ckpt = Checkpointer(url, storage_options=options, filesystem=fs, keep=5)
    handle = ckpt.save_async(2, state)
    assert handle is not None
    try:
        handle.wait()
    except CheckpointError as e:
        return type(e).__name__
    return "committed"
