"""DiLoCo across two sites of a real local job: the outer loop, a hot-swap inside a site.

Two sites by the ``zone`` label: ``a`` (node-0, node-1) and ``b`` (node-2),
one warm spare in ``a`` (node-3), each a separate process talking gloo, on a
real etcd.  Each site trains alone (DDP among its own ranks) for
``inner_steps`` steps, then the sites average their pseudo-gradients and take
an outer Nesterov step.  Killing node-1 in the middle of an inner period
puts the spare in its slot: it receives site ``a``'s inner state from node-0
(not site ``b``'s), and the job ends with the parameters of the run without
a failure, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from orchestrator.spec_loader import load_job_data
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary, tiny_job, wait_for_step
from tests.chaos.sharded_jobs import assert_same_params

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 40
ZONES = {"node-0": {"zone": "a"}, "node-1": {"zone": "a"}, "node-2": {"zone": "b"},
         "node-3": {"zone": "a"}}  # fmt: skip


def diloco_job(name: str, tmp: Path, spares: int) -> object:
    base = tiny_job(name, tmp, steps=STEPS, step_time=0.05, spares=spares).to_dict()
    base["nodes"] = {"min": 3, "max": 3, "spares": spares}
    base["sync"] = {"mode": "diloco", "inner_steps": 10}
    return load_job_data(base)


def test_diloco_hot_swap_in_a_site_ends_as_without_failure(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    ref_dir.mkdir()
    run_dir.mkdir()
    lines: list[str] = []
    with quiet_run(diloco_job("diloco-ref", ref_dir, spares=0), lines, node_labels=ZONES) as run:
        reference = run.wait()
    assert reference.phase is JobPhase.SUCCEEDED, summary(reference, lines)

    lines = []
    with quiet_run(diloco_job("diloco-kill", run_dir, spares=1), lines, node_labels=ZONES) as run:
        wait_for_step(run, 15)
        run.kill_node("node-1")
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries >= 1, summary(result, lines)
    assert_exactly_once(run_dir, STEPS)
    assert_same_params(torch.load(run_dir / "final.pt"), torch.load(ref_dir / "final.pt"))
