"""Training state of a given size, built in the benchmark's own process, and the memory free.

The benchmarks that move state at size (``recovery_at_size.py`` heals it between
workers, ``durable_restore.py`` saves and restores it) measure the same state:
``examples/train_wide.py``'s wide MLP (``layers`` square ``Linear`` layers),
Adam's two moments and an EMA copy of the parameters, all fp32, 16 bytes per
parameter; its width is chosen from the size in decimal GB.  Here it is built
in process as a :class:`checkpoint.TrainState` whose ``objects`` hold the EMA
(as the runtime tracks it), with a checksum of every tensor to compare a
restored state with the one saved.

torch and the project are imported where a function needs them: a benchmark that
forks agents (``recovery_at_size.py``) asks for the memory free without them.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from checkpoint import TrainState

__all__ = ["build_state", "fingerprint", "memory_available", "skipped_for_memory", "state_bytes"]


def memory_available() -> int:
    """``MemAvailable`` of this machine, in bytes (0 when it cannot be read)."""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


def skipped_for_memory(size_gb: float, need: int) -> dict[str, object] | None:
    """The row of a size that needs more memory than is available (None: it fits)."""
    free = memory_available()
    if need <= free:
        return None
    return {
        "state_gb": size_gb,
        "skipped": f"needs about {need / 2**30:.1f} GiB of memory, "
        f"{free / 2**30:.1f} GiB available",
    }


def build_state(size_gb: float, layers: int, *, seed: int, stepped: bool) -> TrainState:
    """The model, Adam and the EMA (``objects["ema"]``) of ``size_gb`` x 10^9 bytes.

    Args:
        seed: the model's initialisation (the EMA starts as a copy of it).
        stepped: take one optimizer step, so Adam's moments exist and differ
            from zero (a saving job's state); False gives the state of a worker
            that resumes: constructed, the optimizer without state.
    """
    import torch

    from checkpoint import TrainState
    from examples.train_wide import wide_mlp, width_for

    torch.manual_seed(seed)
    width = width_for(size_gb * 1e9, layers)
    model = wide_mlp(width, layers)
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if stepped:
        model(torch.randn(4, width)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.lerp_(p, 0.01)
    return TrainState(model, optimizer, samples_seen=seed, objects={"ema": ema})


def _tensors(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    import torch

    assert state.optimizer is not None
    named = [(f"model.{k}", v) for k, v in state.model.state_dict().items()]
    saved = state.optimizer.state_dict()["state"]
    for i in sorted(saved):  # by parameter and entry name: the entries' order is not state
        named += [(f"optim.{i}.{k}", saved[i][k]) for k in sorted(saved[i])]
    named = [(k, v) for k, v in named if torch.is_tensor(v)]
    for name, obj in state.objects.items():
        named += [(f"{name}.{k}", v) for k, v in obj.state_dict().items()]
    return named


def state_bytes(state: TrainState) -> int:
    """Tensor bytes of the model, Adam's state and the objects (what a restore fills)."""
    from examples.train_wide import tensor_bytes

    return tensor_bytes([t for _, t in _tensors(state)])


def fingerprint(state: TrainState) -> str:
    """CRC-32C of every tensor's name, dtype, shape and bytes, in a fixed order."""
    import torch

    from checkpoint.checksums import new_checksum

    crc = new_checksum("crc32c")
    for name, t in _tensors(state):
        crc.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            crc.update(flat.view(torch.uint8).numpy())
    return f"{crc.hexdigest()}/{state.samples_seen}"
