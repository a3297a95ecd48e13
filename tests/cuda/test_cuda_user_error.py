"""An error in the script's own CUDA code is the script's error, not a peer failure.

Rank 0 triggers a device-side assert (an out-of-range index on the GPU) at
step 5.  The worker records, then votes: no collective failed and no newer
generation came, so it reports the script's error and exits; the job fails
with that message and records no recovery.  Two workers share the one GPU,
so the data plane is gloo over CUDA tensors.
"""

from __future__ import annotations

import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.spec.loader import load_job_data
from tests.chaos.jobs import quiet_run, summary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCRIPT = """
import torch
import torch.nn.functional as F
from torch import nn

from agents import runtime

session = runtime.init()
model = session.wrap(nn.Linear(4, 2))  # moved to the worker's GPU
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session.track(model=model, optimizer=opt)
for step in session.steps():
    with session.guard():
        x = torch.randn(8, 4, device=session.device)
        y = torch.randint(0, 2, (8,), device=session.device)
        if step == 5 and session.rank == 0:
            x = x[torch.tensor([99], device=session.device)]  # out of range: device-side assert
            x.sum().item()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if session.step_failed:
        continue
session.close()
"""


def test_a_device_side_assert_fails_the_job_as_the_scripts_error(tmp_path: Path) -> None:
    script = tmp_path / "train_cuda_error.py"
    script.write_text(textwrap.dedent(SCRIPT))
    spec = load_job_data(
        {
            "name": "cuda-user-error",
            "entrypoint": {"script": str(script)},
            "nodes": {"min": 2, "max": 2, "spares": 0},
            "max_steps": 50,
            "comm": {"backend": "gloo"},
            "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 0},
            "fault_tolerance": {"max_restarts": 0, "heartbeat_interval": "500ms"},
        }
    )
    lines: list[str] = []
    with quiet_run(spec, lines, timeout=timedelta(seconds=120)) as run:
        result = run.wait()
    assert result.phase is JobPhase.FAILED, summary(result, lines)
    assert result.recoveries == 0, summary(result, lines)
    failed = [e for e in result.events if e.type == "Phase" and "Failed" in e.message]
    assert failed and "device-side assert" in failed[-1].message, summary(result, lines)
