"""An error of the training script's own is not a peer failure.

Every rank raises ``RuntimeError("socket timed out ...")`` at step 5: words
that once looked like a network failure.  The workers record, then vote
(:mod:`agents.failures`): no collective failed and no newer generation is
published, so each reports a ``user_error`` break and exits with the error.
The controller restarts the job once (``max_restarts: 1``), the error comes
back, and the job fails with the script's message, without any recovery.
"""

from __future__ import annotations

import re
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator import keys
from orchestrator.api import JobPhase
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.spec_loader import load_job_data
from tests.chaos.jobs import quiet_run, summary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MESSAGE = "socket timed out talking to my database"

SCRIPT = f'''
import torch
import torch.nn.functional as F
from torch import nn

from agents import runtime

session = runtime.init()
model = session.wrap(nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session.track(model=model, optimizer=opt)
for step in session.steps():
    with session.guard():
        if step == 5:
            raise RuntimeError("{MESSAGE}")
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if session.step_failed:
        continue
session.close()
'''


def test_an_error_of_the_script_fails_the_job_without_recovery(
    tmp_path: Path, etcd: EmbeddedEtcd
) -> None:
    script = tmp_path / "train_user_error.py"
    script.write_text(textwrap.dedent(SCRIPT))
    spec = load_job_data(
        {
            "name": "user-error",
            "entrypoint": str(script),
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "max_steps": 50,
            "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 0},
            "fault_tolerance": {"max_restarts": 1, "heartbeat_interval": "500ms"},
        }
    )
    lines: list[str] = []
    options = EtcdOptions((etcd.endpoint,))
    with quiet_run(spec, lines, etcd=options, timeout=timedelta(seconds=90)) as run:
        result = run.wait()
        recorded = run.client.get_prefix(keys.job_recoveries(spec.name))
    output = "\n".join(lines)
    assert result.phase is JobPhase.FAILED, summary(result, lines)
    assert result.wall_s < 60, summary(result, lines)
    assert MESSAGE in output, summary(result, lines)
    assert "RecoveryError" not in output, summary(result, lines)
    assert not re.search(r"\[rank\d+\]: \[rank\d+\]:", output), summary(result, lines)
    assert result.recoveries == 0, summary(result, lines)
    assert recorded == [], [kv.key for kv in recorded]
    failed = [e for e in result.events if e.type == "Phase" and "Failed" in e.message]
    assert failed and MESSAGE in failed[-1].message, failed
