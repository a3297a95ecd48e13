"""A whole job on NCCL through the runtime, on the one GPU there is.

One training node (world size 1: NCCL refuses two ranks on one device) and
a warm spare, with the GPU example's comm block (hierarchical all-reduce,
8-bit QSGD on the inter-node stage) and periodic checkpoints.  The training
node is SIGKILLed: with no live peer, the spare forms a new NCCL group on
the same GPU, restores the newest checkpoint onto it and finishes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from tests.chaos.jobs import quiet_run, step_log, summary, tiny_job
from tests.cuda.conftest import record

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]


def test_nccl_job_with_the_gpu_examples_comm_survives_losing_its_node(tmp_path: Path) -> None:
    comm = {
        "backend": "nccl",
        "hierarchical": True,
        "compression": {"type": "qsgd", "bits": 8, "inter_node_only": True},
    }
    spec = tiny_job("cuda-nccl", tmp_path, steps=60, spares=1, comm=comm)
    spec = dataclasses.replace(
        spec,
        nodes=dataclasses.replace(spec.nodes, min=1, max=1),
        checkpoint=dataclasses.replace(spec.checkpoint, every_steps=10),
    )
    lines: list[str] = []
    with quiet_run(spec, lines, kill_node_at_step=25) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.killed_node is not None
    # the spare started from a committed checkpoint (every 10 steps) of what the killed
    # node had trained; which one depends on how far a fast GPU got before the kill
    # landed (30 on an H200, where the status still said 29)
    logs = step_log(tmp_path)
    spare = [s for w, s in logs.items() if not w.startswith(result.killed_node)]
    killed = [step for w, s in logs.items() if w.startswith(result.killed_node) for step in s]
    assert spare and spare[0] and killed, (spare, summary(result, lines))
    first = spare[0][0]
    assert first % 10 == 0 and 10 <= first <= max(killed) + 1, (first, max(killed), spare)
    params = torch.load(tmp_path / "final.pt")
    assert all(t.device.type == "cuda" for t in params.values())
    record("nccl_job_node_lost", recoveries=result.recoveries, wall_s=round(result.wall_s, 2))
