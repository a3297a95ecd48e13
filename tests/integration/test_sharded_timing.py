"""A sharded model's steps are timed from FSDP2's own collectives, on real gloo ranks.

Two or four real processes (``tests.gloo.run_gloo``) shard a small MLP with
``fully_shard`` (1-D: ``fsdp``; 2-D: ``hsdp``, replicas of one or two ranks) and
time it with :func:`agents.state.sharded_timing.time_collectives`.  The last
rank computes longer each step (a busy loop in its step, as a slow GPU or a
throttled host would): it must show the longer compute time per step and the
shorter wait, its peers the reverse, as a DDP job's ranks do.  A step with no
collective is not timed.  The same model trained with and without the timed
collectives ends with the same parameters (they are FSDP2's calls, not new ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.faults.busy import spin
from tests.gloo import run_gloo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 8
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
#: steps before the clock starts
WARM = 2
#: seconds of extra compute per step on the slow rank (long beside a shared
#: machine's scheduling noise: the assertions compare the ranks, not the clock)
SLOW_S = 0.15


def _train(
    rank: int, world: int, mesh_shape: tuple[int, ...], timed: bool, slow_s: float
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from agents.runtime.step_timing import StepTiming
    from agents.state.sharded_timing import time_collectives

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    fully_shard(net, mesh=mesh)
    timing = StepTiming()
    installed = timed and time_collectives(
        net, timing, shards=mesh_shape[-1], replicas=mesh_shape[0] if len(mesh_shape) == 2 else 1
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(WARM + STEPS):
        if step == WARM:  # FSDP2's lazy init and gloo's first connections are behind
            timing.reset()
            timing.compute_s = timing.wait_s = 0.0
            timing.steps = 0
            timing.step_done()  # the clock starts
        opt.zero_grad()
        if rank == world - 1:
            spin(slow_s)
        net(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        timing.step_done()
    timing.step_done()  # a step without a collective: not timed
    # plain lists: a tensor would travel through shared memory the exiting rank frees
    full = {n: p.full_tensor().detach().tolist() for n, p in net.named_parameters()}
    dist.barrier()
    return {
        "installed": installed,
        "steps": timing.steps,
        "compute": timing.compute_s / max(timing.steps, 1),
        "wait": timing.wait_s / max(timing.steps, 1),
        "params": full,
    }


Train = Callable[[int, tuple[int, ...], bool, float], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def train() -> Train:
    """``_train`` on real ranks, each setting run once: the fsdp test's timed run is
    also the one the equality test compares."""
    runs: dict[tuple[Any, ...], list[dict[str, Any]]] = {}

    def run(world: int, mesh_shape: tuple[int, ...], timed: bool, slow_s: float) -> Any:
        key = (world, mesh_shape, timed, slow_s)
        if key not in runs:
            runs[key] = run_gloo(
                _train, world, mesh_shape, timed, slow_s, timeout=150, env=ONE_THREAD
            )
        return runs[key]

    return run


@pytest.mark.parametrize(
    ("world", "mesh_shape"),
    [
        (2, (2,)),  # fsdp: all-gather and reduce-scatter
        (2, (2, 1)),  # hsdp, one rank per replica: the replica all-reduce only
        pytest.param(4, (2, 2), marks=pytest.mark.long),  # hsdp: all three
    ],
    ids=["fsdp", "hsdp-2x1", "hsdp-2x2"],
)
def test_the_slow_rank_of_a_sharded_model_computes_longer_its_peers_wait(
    train: Train, world: int, mesh_shape: tuple[int, ...]
) -> None:
    results = train(world, mesh_shape, True, SLOW_S)
    slow, healthy = results[-1], results[0]
    assert all(r["installed"] for r in results)
    assert all(r["steps"] == STEPS for r in results), [r["steps"] for r in results]
    # the slow rank computes longer by about its extra time; the healthy one waits for
    # it in the collectives, the slow one much less
    assert slow["compute"] - healthy["compute"] > SLOW_S / 2, (slow, healthy)
    assert healthy["wait"] > SLOW_S / 2, (slow, healthy)
    assert healthy["wait"] > 2 * slow["wait"], (slow, healthy)


def test_timed_collectives_train_what_fsdp2_s_own_train(train: Train) -> None:
    timed = train(2, (2,), True, SLOW_S)  # the fsdp run above
    plain = train(2, (2,), False, 0.0)  # no slow rank: a busy loop changes no parameter
    assert [r["installed"] for r in plain] == [False, False]
    for a, b in zip(timed, plain, strict=True):
        for name, p in a["params"].items():
            assert torch.equal(torch.tensor(p), torch.tensor(b["params"][name])), name
