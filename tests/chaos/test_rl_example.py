"""The reinforcement-learning example survives a node failure and loses nothing.

examples/train_cartpole.py: policy-gradient agents on gymnasium's CartPole, one
environment and experience buffer per rank, gradients averaged by DDP.  A run
with a node SIGKILLed mid-training must end with the same policy as a run
without failures, since a replacement replays exactly the episodes of the rank
it takes over.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from tests.chaos.jobs import REPO, assert_exactly_once, quiet_run, summary

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]

pytest.importorskip("gymnasium")

STEPS = 60
# A step takes at least STEP_TIME: the run sees the job's step through beats, so
# without a floor the 60 steps (about 10 ms each) can all be done before a kill
# aimed at step 12 lands, and nothing is left to recover.
STEP_TIME = 0.05


def cartpole_job(name: str, tmp: Path, spares: int) -> JobSpec:
    (tmp / "steps").mkdir(exist_ok=True)
    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(REPO / "examples" / "train_cartpole.py"),
                "args": [
                    "--episodes",
                    "2",
                    "--max-len",
                    "60",
                    "--out",
                    str(tmp / "policy.pt"),
                    "--step-log",
                    str(tmp / "steps"),
                    "--step-time",
                    str(STEP_TIME),
                ],
                "env": {"RINGMASTER_LOG_EVERY": "1000"},
            },
            "nodes": {"min": 2, "max": 2, "spares": spares},
            "max_steps": STEPS,
            "checkpoint": {"url": f"file://{tmp}/ckpt", "every_steps": 0},
            "fault_tolerance": {"heartbeat_interval": "500ms"},
        }
    )


@pytest.mark.long  # short form: the flagship LM's node kill (integration/test_flagship_example.py)
def test_cartpole_policy_survives_a_node_kill_unchanged(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    ref_dir.mkdir()
    run_dir.mkdir()
    lines: list[str] = []
    with quiet_run(cartpole_job("rl-reference", ref_dir, spares=0), lines) as run:
        reference = run.wait()
    assert reference.phase is JobPhase.SUCCEEDED, summary(reference, lines)

    lines = []
    with quiet_run(cartpole_job("rl-kill", run_dir, spares=1), lines, kill_node_at_step=12) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.killed_node is not None and result.recoveries == 1, summary(result, lines)
    assert_exactly_once(run_dir, STEPS)

    a, b = torch.load(ref_dir / "policy.pt"), torch.load(run_dir / "policy.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7), f"{k} differs"
    # training moved the policy away from its initial parameters
    torch.manual_seed(0)
    initial = torch.nn.Sequential(
        torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)
    ).state_dict()
    trained = {k.removeprefix("module."): v for k, v in a.items()}
    assert initial.keys() == trained.keys()
    assert any(not torch.allclose(initial[k], trained[k]) for k in initial)
