"""Hot-swap of a GPU job: two workers on one GPU, gloo over CUDA tensors, a
node SIGKILLed, the spare takes over in-process, nothing lost.

Both training nodes (and the spare) bind local rank 0, so all three share the
one GPU; the data plane is gloo because NCCL refuses two ranks on a device.
The final parameters equal a fault-free run's on the same GPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary, tiny_job
from tests.cuda.conftest import record

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

STEPS = 80


def _run(tmp: Path, name: str, kill_at: int | None) -> tuple[dict[str, torch.Tensor], object]:
    lines: list[str] = []
    spec = tiny_job(name, tmp, steps=STEPS, spares=1 if kill_at else 0, comm={"backend": "gloo"})
    started = time.monotonic()
    with quiet_run(spec, lines, kill_node_at_step=kill_at) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert_exactly_once(tmp, STEPS)
    params = torch.load(tmp / "final.pt")
    assert all(t.device.type == "cuda" for t in params.values())  # trained on the GPU
    record(name, seconds=round(time.monotonic() - started, 2), recoveries=result.recoveries)
    return params, result


def test_gpu_job_survives_node_kill_on_gloo(tmp_path: Path) -> None:
    (tmp_path / "ref").mkdir()
    (tmp_path / "kill").mkdir()
    reference, _ = _run(tmp_path / "ref", "cuda-reference", None)
    params, result = _run(tmp_path / "kill", "cuda-kill", 30)
    assert result.recoveries == 1  # type: ignore[attr-defined]
    for k in reference:
        torch.testing.assert_close(params[k], reference[k], rtol=1e-6, atol=1e-7)
