"""Step timing read from the GPU (:mod:`agents.runtime.device_timing`), on one GPU.

* **A busy GPU is called, its peer is not.**  Two ranks in two processes on
  the same GPU (one GPU cannot hold two NCCL ranks, so their gradients are
  averaged by gloo through host memory, as the DDP hook would on NCCL).  Each
  trains the same small model on the GPU and times its steps from CUDA events.
  Rank 1's compute stream must first wait behind a competing stream that keeps
  its GPU busy (spin kernels, ``torch.cuda._sleep``) every step.  Their totals,
  as the heartbeats carry them, go to the controller's own rule
  (:class:`~orchestrator.controller.stragglers.StragglerWatch`): rank 1's node
  must be called and rank 0's not; rank 0 must show the wait.  What it proves:
  the events see time the device spends on other work, and a peer's wait comes
  out as wait, not compute.  It does not prove NCCL's own timing (the next test
  runs the hook on an NCCL group of one rank).
* **The runtime's DDP hook on NCCL.**  One rank, an NCCL group of one, the
  runtime's comm hook (:meth:`CollectiveFailures.allreduce_hook`) with a
  :class:`DeviceStepTiming`: every step is timed, once the device has run it.
* **Never a synchronisation.**  A step whose kernel runs for a second returns
  from ``step_done`` at once and is counted only once the device finished it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.cuda.conftest import record
from tests.gloo import run_gloo

pytestmark = [pytest.mark.timeout(300)]

STEPS = 30
#: GPU cycles rank 1's compute waits behind each step (about 20 ms at ~1.5 GHz)
BUSY_CYCLES = 30_000_000


def _rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn

    from agents.runtime.device_timing import DeviceStepTiming

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    timing = DeviceStepTiming(device)
    competitor = torch.cuda.Stream(device)
    x = torch.randn(64, 256, device=device)
    for step in range(STEPS + 2):
        if step == 2:  # warm-up behind: the clock starts
            timing.reset()
            timing.compute_s = timing.wait_s = 0.0
            timing.steps = 0
            timing.step_done()
        if rank == 1:  # a competing stream keeps this rank's GPU busy first
            with torch.cuda.stream(competitor):
                torch.cuda._sleep(BUSY_CYCLES)
            torch.cuda.current_stream(device).wait_stream(competitor)
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        timing.posted()  # the gradients are ready on the device here
        grads_of = [p.grad for p in net.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads_of]).cpu()
        dist.all_reduce(flat)  # gloo: waits for the peer
        grads = flat.to(device, non_blocking=False) / world
        timing.completed()  # recorded after the averaged gradients are back
        offset = 0
        for g in grads_of:
            g.copy_(grads[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        opt.step()
        timing.step_done()
    torch.cuda.synchronize(device)
    timing.resolve()
    return {"steps": timing.steps, "compute_s": timing.compute_s, "wait_s": timing.wait_s}


def test_a_rank_whose_gpu_is_kept_busy_is_called_and_its_peer_is_not() -> None:
    from orchestrator.controller.stragglers import StragglerWatch, node_timings
    from orchestrator.spec.job import StragglerSpec
    from orchestrator.state.records import Member, Plan, ProgressRecord, Telemetry

    results = run_gloo(_rank, 2, timeout=240)
    assert all(r["steps"] == STEPS for r in results), results
    record("busy_gpu_rank", ranks=results)
    plan = Plan(1, [Member("calm", 0, 1), Member("busy", 1, 1)], spares=[])

    def progress(totals: list[dict[str, Any]] | None) -> dict[str, ProgressRecord]:
        out = {}
        for i, node in enumerate(("calm", "busy")):
            t = totals[i] if totals else {"compute_s": 0.0, "wait_s": 0.0, "steps": 0}
            out[f"{node}-0"] = ProgressRecord(
                step=0,
                generation=1,
                rank=i,
                world_size=2,
                pid=1,
                beat=0.0,
                step_time=0.0,
                telemetry=Telemetry(
                    generation=1,
                    compute_s=t["compute_s"],
                    wait_s=t["wait_s"],
                    timed_steps=t["steps"],
                ),
            )
        return out

    before = {w: p.telemetry for w, p in progress(None).items()}
    timings = node_timings(before, progress(results), plan)
    assert timings is not None and set(timings) == {"calm", "busy"}, timings
    watch = StragglerWatch(StragglerSpec(windows=1))
    called, _ = watch.judge(timings)
    assert [s.node for s in called] == ["busy"], (timings, called)
    assert timings["calm"].wait_s > timings["busy"].wait_s, timings


def test_the_runtime_ddp_hook_is_timed_on_an_nccl_group() -> None:
    import os

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from agents.runtime.device_timing import DeviceStepTiming
    from agents.runtime.failures import CollectiveFailures
    from orchestrator.process_lifetime import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        timing = DeviceStepTiming(device)
        failures = CollectiveFailures(timing)
        net = DDP(nn.Linear(512, 512).to(device), device_ids=[0])
        net.register_comm_hook(dist.group.WORLD, failures.allreduce_hook())
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        x = torch.randn(32, 512, device=device)
        timing.step_done()
        for _ in range(STEPS):
            opt.zero_grad()
            net(x).sum().backward()
            opt.step()
            timing.step_done()
        torch.cuda.synchronize(device)
        timing.resolve()
        assert failures.take() is None
        assert (timing.steps, timing.pending) == (STEPS, 0)
        assert timing.compute_s > 0 and timing.wait_s >= 0
        record(
            "ddp_nccl_hook", steps=timing.steps, compute_s=timing.compute_s, wait_s=timing.wait_s
        )
    finally:
        dist.destroy_process_group()


def test_step_done_never_waits_for_the_device() -> None:
    from agents.runtime.device_timing import DeviceStepTiming

    device = torch.device("cuda", 0)
    timing = DeviceStepTiming(device)
    timing.step_done()
    started = timing.collective_started()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time
    timing.collective_ended(started)
    host = time.perf_counter()
    timing.step_done()
    returned_after = time.perf_counter() - host
    queued = timing.pending
    torch.cuda.synchronize(device)
    timing.resolve()
    record("no_sync", step_done_s=returned_after, pending_before=queued, steps=timing.steps)
    assert queued == 1 and returned_after < 0.05, (queued, returned_after)
    assert timing.steps == 1 and timing.wait_s > 0.1, (timing.steps, timing.wait_s)
