"""ElasticDDP.no_sync: gradient accumulation as on DDP, across a new process group too.

Two real gloo processes.  Inside ``no_sync`` a backward pass leaves each
rank's own gradient (the ranks' differ); the first backward after it
all-reduces the accumulated sum, and the result equals torch's own DDP doing
the same accumulation.  The second half forms a new process group (a new
generation) while inside ``no_sync`` and rebuilds the DDP on it: the setting
holds, and the exchange after it runs on the new group.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.gloo import run_gloo

pytestmark = pytest.mark.integration


def _grads(module: Any) -> list[Any]:
    return [p.grad.detach().clone() for p in module.parameters()]


def _local_grads(module: Any, *inputs: Any) -> list[Any]:
    """Gradients of the summed losses on a private copy of ``module`` (no DDP)."""
    twin = copy.deepcopy(module)
    for x in inputs:
        twin(x).pow(2).sum().backward()
    return _grads(twin)


def _flat(tensors: list[Any]) -> list[float]:
    """Plain floats: tensors would cross the result queue as shared memory of a dead process."""
    return [float(v) for t in tensors for v in t.reshape(-1)]


def _gather(tensors: list[Any]) -> list[Any]:
    import torch
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    out = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _accumulate(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from agents.runtime.elastic_ddp import ElasticDDP
    from agents.runtime.failures import CollectiveFailures

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    plain = copy.deepcopy(net)
    gen = torch.Generator().manual_seed(100 + rank)
    x1, x2, x3 = (torch.randn(5, 3, generator=gen) for _ in range(3))
    local_1 = _local_grads(net, x1)
    local_12 = _local_grads(net, x1, x2)

    model = ElasticDDP(net, failures=CollectiveFailures())
    with model.no_sync():  # entered before any DDP exists, as a script may
        model.rebuild()
        model(x1).pow(2).sum().backward()
        inside = _grads(net)
    after_first = [inside[i].clone() for i in range(len(inside))]
    model(x2).pow(2).sum().backward()
    synced = _grads(net)

    ddp = DistributedDataParallel(plain)
    with ddp.no_sync():
        ddp(x1).pow(2).sum().backward()
    ddp(x2).pow(2).sum().backward()
    reference = _grads(plain)

    inside_gathered = _gather(after_first)
    synced_gathered = _gather(synced)

    # A new generation: a new group formed while inside no_sync, the DDP rebuilt on it.
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(str(Path(store_dir) / "gen2"), world_size),
        rank=rank,
        world_size=world_size,
    )
    with model.no_sync():
        model.drop()
        model.rebuild()
        model(x3).pow(2).sum().backward()
        inside_new = _grads(net)
    local_3 = _local_grads(net, x3)
    model(x1).pow(2).sum().backward()
    synced_new = _grads(net)
    local_31 = _local_grads(net, x3, x1)
    return {
        "inside_is_local": all(torch.allclose(a, b) for a, b in zip(inside, local_1, strict=True)),
        "inside_differs": not torch.allclose(inside_gathered[0], inside_gathered[1]),
        "synced_same_everywhere": torch.allclose(synced_gathered[0], synced_gathered[1]),
        "synced_vs_ddp": max(
            float((a - b).abs().max()) for a, b in zip(synced, reference, strict=True)
        ),
        "local_12": _flat(local_12),
        "synced": _flat(synced),
        "inside_new_is_local": all(
            torch.allclose(a, b) for a, b in zip(inside_new, local_3, strict=True)
        ),
        "local_31": _flat(local_31),
        "synced_new": _flat(synced_new),
        "flag_restored": model.require_backward_grad_sync,
    }


def test_no_sync_accumulates_locally_then_reduces_like_ddp(tmp_path: Path) -> None:
    import torch

    ranks = run_gloo(_accumulate, 2, str(tmp_path), timeout=60)
    for r in ranks:
        for k in ("local_12", "synced", "local_31", "synced_new"):
            r[k] = torch.tensor(r[k])
    for r in ranks:
        assert r["inside_is_local"], "gradients were exchanged inside no_sync"
        assert r["synced_same_everywhere"], "the step after no_sync did not all-reduce"
        assert r["synced_vs_ddp"] < 1e-6, f"differs from torch DDP by {r['synced_vs_ddp']}"
        assert r["inside_new_is_local"], "no_sync did not hold across a new group's DDP"
        assert r["flag_restored"] is True
    assert ranks[0]["inside_differs"], "the ranks' local gradients should differ"
    # the all-reduce averages the ranks' accumulated sums
    expected = (ranks[0]["local_12"] + ranks[1]["local_12"]) / 2
    assert torch.allclose(ranks[0]["synced"], expected, atol=1e-6)
    expected_new = (ranks[0]["local_31"] + ranks[1]["local_31"]) / 2
    assert torch.allclose(ranks[0]["synced_new"], expected_new, atol=1e-6)
    assert torch.allclose(ranks[1]["synced_new"], expected_new, atol=1e-6)
