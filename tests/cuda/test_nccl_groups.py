"""NCCL groups in-process: formed, aborted and formed again without a restart.

One GPU holds one NCCL rank (NCCL refuses two ranks on one device), so the
in-process cycle is shown with a group of one here; the tests that need two
ranks are written too and skip where fewer than two GPUs are visible.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from agents.runtime import boundary
from agents.runtime.process_group import (
    NCCL_ERROR_HANDLING,
    abort_groups,
    choose_device,
    form_group,
    set_op_timeout,
    teardown_group,
)
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from tests.cuda.conftest import ONE_GPU, gpus, record
from tests.faults.stuck_pair import run_stuck_pair

pytestmark = pytest.mark.integration


def test_nccl_group_of_one_forms_aborts_and_forms_again(etcd_client: EtcdClient) -> None:
    backend, device = choose_device("auto", 0)
    assert (backend, device.type) == ("nccl", "cuda")
    job = f"nccl-{uuid.uuid4().hex[:8]}"
    timings: dict[str, float] = {}
    for generation in (1, 2, 3):
        started = time.monotonic()
        groups = form_group(
            etcd_client, job, generation, 0, 1, "127.0.0.1", backend=backend, device=device
        )
        timings[f"form_{generation}_s"] = time.monotonic() - started
        assert dist.get_backend() == "nccl"
        assert groups.control is not None  # the boundary's gloo group beside NCCL
        assert os.environ[NCCL_ERROR_HANDLING[0]] == NCCL_ERROR_HANDLING[1]
        t = torch.full((1024,), float(generation), device=device)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert t[0].item() == generation
        agreed = boundary.agree(
            boundary.Proposal(generation, 0, 0, False, False, False), group=groups.control
        )
        assert agreed.generation == generation
        set_op_timeout(groups, timedelta(seconds=7))
        started = time.monotonic()
        abort_groups(groups)
        timings[f"abort_{generation}_s"] = time.monotonic() - started
        started = time.monotonic()
        teardown_group()
        timings[f"teardown_{generation}_s"] = time.monotonic() - started
        assert not dist.is_initialized()
    record("nccl_group_of_one", **{k: round(v, 4) for k, v in timings.items()})


def test_boundary_on_the_control_group_costs_per_step(etcd_client: EtcdClient) -> None:
    """The step boundary's vector travels on gloo beside NCCL: its cost per step,
    and that it never waits for queued GPU work."""
    backend, device = choose_device("auto", 0)
    groups = form_group(
        etcd_client,
        f"ctl-{uuid.uuid4().hex[:8]}",
        1,
        0,
        1,
        "127.0.0.1",
        backend=backend,
        device=device,
    )
    try:
        proposal = boundary.Proposal(1, 0, 0, False, False, False)
        for _ in range(20):
            boundary.agree(proposal, group=groups.control)
        n = 500
        started = time.perf_counter()
        for _ in range(n):
            boundary.agree(proposal, group=groups.control)
        per_step = (time.perf_counter() - started) / n
        # queue ~100 ms of GPU work, then vote: the vote must not wait for it
        a = torch.randn(8192, 8192, device=device)
        torch.cuda.synchronize()
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        started = time.perf_counter()
        boundary.agree(proposal, group=groups.control)
        vote_while_busy = time.perf_counter() - started
        started = time.perf_counter()
        torch.cuda.synchronize()
        gpu_left = time.perf_counter() - started
        record(
            "control_group_boundary",
            per_step_us=round(per_step * 1e6, 1),
            vote_while_gpu_busy_ms=round(vote_while_busy * 1e3, 3),
            gpu_work_left_ms=round(gpu_left * 1e3, 1),
        )
        assert vote_while_busy < gpu_left  # the vote did not synchronise the stream
    finally:
        teardown_group()


@pytest.mark.skipif(gpus() < 2, reason=ONE_GPU)
def test_abort_ends_an_nccl_collective_stuck_on_a_stopped_peer(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Two NCCL ranks; one is SIGSTOPped; the other's all-reduce ends by the
    guard's abort once the generation moves on, long before its timeout."""
    # the guard's operation timeout is 120 s: only the abort can end it this soon
    result = run_stuck_pair(etcd.endpoint, tmp_path, backend="nccl", op_timeout=120, pause=2)
    record("nccl_abort_stuck_collective", **result)
    assert result["ended_by"] == "abort", result
    assert result["seconds"] < 2 + 5, result
