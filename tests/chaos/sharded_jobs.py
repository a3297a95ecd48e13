"""Sharded jobs for the chaos tests: specs, the fault-free parameters, slice assembly."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from tests.chaos.jobs import REPO


def sharded_job(
    name: str,
    tmp: Path,
    sharding: str,
    *,
    nodes: int,
    nproc: int,
    steps: int,
    every_steps: int = 0,
    step_time: float = 0.03,
    redundancy: int | None = None,
    spares: int = 1,
    min_nodes: int | None = None,
    optimizer: str = "sgd",
    mesh: str | None = None,
) -> JobSpec:
    """``nodes`` active nodes of ``nproc`` workers + ``spares``, running train_sharded.py
    (``mesh``: its ``--mesh``, which replaces ``sharding``)."""
    (tmp / "steps").mkdir(exist_ok=True)
    (tmp / "out").mkdir(exist_ok=True)
    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(REPO / "examples" / "train_sharded.py"),
                "args": [
                    *(["--mesh", mesh] if mesh else ["--sharding", sharding]),
                    "--step-time",
                    str(step_time),
                    "--out",
                    str(tmp / "out"),
                    "--step-log",
                    str(tmp / "steps"),
                    "--optimizer",
                    optimizer,
                ],
                "env": {"OMP_NUM_THREADS": "1"},
            },
            "nodes": {"min": min_nodes or nodes, "max": nodes, "spares": spares},
            "nproc_per_node": nproc,
            "max_steps": steps,
            "checkpoint": {"url": f"file://{tmp}/ckpt", "every_steps": every_steps},
            "fault_tolerance": {
                "hang_timeout": "30s",
                "heartbeat_interval": "500ms",
                "preemption_grace": "20s",
                # the job file's setting (the script passes no override to wrap())
                **({} if redundancy is None else {"redundancy": {"every_steps": redundancy}}),
            },
        }
    )


def assembled(out: Path) -> dict[str, torch.Tensor]:
    """Full parameters from the rows every rank wrote (replicas must agree)."""
    parts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for f in sorted(out.glob("rank-*.pt")):
        for name, (start, stop, rows) in torch.load(f).items():
            seen = parts.setdefault(name, {})
            if (start, stop) in seen:
                assert torch.equal(seen[(start, stop)], rows), f"replicas of {name} differ"
            seen[(start, stop)] = rows
    full = {}
    for name, pieces in parts.items():
        ordered = [pieces[k] for k in sorted(pieces) if k[1] > k[0]]
        full[name] = torch.cat(ordered)
    return full


def fault_free(steps: int, optimizer: str = "sgd") -> dict[str, torch.Tensor]:
    """train_sharded.py's parameters after ``steps`` steps, computed in this process."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from train_sharded import make_optimizer
        from train_tiny import CLASSES, FEATURES, GLOBAL_BATCH, batch, dataset
    finally:
        sys.path.remove(str(REPO / "examples"))
    torch.manual_seed(0)
    x, y = dataset()
    net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    opt = make_optimizer(optimizer, net.parameters())
    for step in range(steps):
        xb, yb = batch(step, 0, 1, x, y)
        opt.zero_grad()
        (F.cross_entropy(net(xb), yb, reduction="sum") / GLOBAL_BATCH).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        diff = (got[k] - want[k]).abs().max().item()
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6), f"{k} differs by {diff}"
