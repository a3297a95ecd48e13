"""More workers than GPUs on a node (``oversubscribe: true``, ``comm.backend: gloo``).

One node with two workers and the one GPU there is: local rank 1 has no
device of its own and shares device 0 with local rank 0.  The job trains on
the GPU and ends with the parameters of a run of two one-worker nodes (each
on device 0 too), the same two ranks' data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from orchestrator.spec.loader import load_job_data
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary, tiny_job
from tests.cuda.conftest import gpus, record

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

STEPS = 40


def test_two_workers_share_the_one_gpu_on_gloo(tmp_path: Path) -> None:
    if gpus() != 1:
        pytest.skip("needs a node that shows exactly one CUDA device")
    finals = []
    for name, nodes, nproc in (("cuda-two-nodes", 2, 1), ("cuda-oversubscribed", 1, 2)):
        tmp = tmp_path / name
        tmp.mkdir()
        data = tiny_job(name, tmp, steps=STEPS, spares=0, comm={"backend": "gloo"}).to_dict()
        data.update(nproc_per_node=nproc, oversubscribe=nproc > 1)
        data["nodes"] = {"min": nodes, "max": nodes, "spares": 0}
        lines: list[str] = []
        with quiet_run(load_job_data(data), lines) as run:
            result = run.wait()
        assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
        assert_exactly_once(tmp, STEPS)
        params = torch.load(tmp / "final.pt")
        assert all(t.device == torch.device("cuda", 0) for t in params.values())
        finals.append(params)
    for k in finals[0]:
        torch.testing.assert_close(finals[1][k], finals[0][k], rtol=1e-6, atol=1e-7)
    record("oversubscribed_gpu_gloo", steps=STEPS)
