"""DiLoCo on GPU workers: the model on the GPU, the outer state in host memory.

Two cases on the one GPU there is:

* Two sites over gloo with CUDA tensors (NCCL refuses two ranks on one
  device): site ``a`` is node-2, site ``b`` node-0 and node-1, a warm spare of
  ``b`` takes node-1's slot when it is SIGKILLed.  The spare receives site
  ``b``'s state (CUDA tensors on the site's own group, the outer state on the
  host) from node-0; the run ends with the parameters of a fault-free run of
  the same mode on the same GPU.
* One node on NCCL (a site of one: the site's groups are NCCL's for the data,
  gloo's for the host and between sites), SIGKILLed; the spare resumes from
  the newest durable checkpoint, whose outer state a restore put on the GPU,
  and ends with the parameters of a fault-free run.
* The same with an FSDP2 model in the site of one (the outer state as the
  rank's slices).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary
from tests.chaos.sharded_jobs import assembled, sharded_job
from tests.cuda.conftest import record
from tests.integration.test_diloco import STEPS, STREAMING, ZONES, diloco_job, kill_in_site_b

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]


def _on(spec: JobSpec, **changes: object) -> JobSpec:
    data = spec.to_dict()
    data.update(changes)
    return load_job_data(data)


def _final(tmp: Path) -> dict[str, torch.Tensor]:
    params = torch.load(tmp / "final.pt")
    assert all(t.device.type == "cuda" for t in params.values())  # trained on the GPU
    return params


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_two_sites_on_gloo_hot_swap_in_a_site_ends_as_a_fault_free_run(tmp_path: Path) -> None:
    gloo = {"backend": "gloo"}
    ref, kill = tmp_path / "ref", tmp_path / "kill"
    ref.mkdir()
    kill.mkdir()
    lines: list[str] = []
    spec = _on(diloco_job("cuda-diloco-ref", ref, 0, STREAMING, step_time=0.05), comm=gloo)
    with quiet_run(spec, lines, node_labels=ZONES) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    want = _final(ref)

    spec = _on(diloco_job("cuda-diloco-kill", kill, 1, STREAMING, step_time=0.05), comm=gloo)
    started = time.monotonic()
    result, status = kill_in_site_b(spec, kill, lines)
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries >= 1, summary(result, lines)
    assert_exactly_once(kill, STEPS)
    assert status is not None and status.sync and status.sync["site_bytes"] > 0, status
    _same(_final(kill), want)
    record(
        "diloco_two_sites_gloo_hot_swap",
        seconds=round(time.monotonic() - started, 2),
        recoveries=result.recoveries,
        outer_steps=status.sync["outer_steps"],
    )


def test_one_node_on_nccl_resumes_its_outer_state_from_a_checkpoint(tmp_path: Path) -> None:
    lines: list[str] = []
    finals = []
    for name, kill_at in (("cuda-diloco-nccl-ref", None), ("cuda-diloco-nccl-kill", 25)):
        tmp = tmp_path / name
        tmp.mkdir()
        base = diloco_job(name, tmp, 0, {"mode": "diloco", "inner_steps": 10}, step_time=0.05)
        spec = _on(
            base,
            comm={"backend": "nccl"},
            nodes={"min": 1, "max": 1, "spares": 1 if kill_at else 0},
            checkpoint={"url": f"file://{tmp}/ckpt", "every_steps": 10},
        )
        with quiet_run(spec, lines, kill_node_at_step=kill_at) as run:
            result = run.wait()
        assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
        if kill_at:
            assert result.killed_node is not None and result.recoveries >= 1, summary(result, lines)
            assert any("resumed from" in line for line in lines), summary(result, lines)
        finals.append(_final(tmp))
    _same(finals[1], finals[0])
    record("diloco_one_node_nccl_resume", recoveries=result.recoveries)


def test_fsdp2_site_of_one_on_nccl_resumes_its_outer_slices_from_a_checkpoint(
    tmp_path: Path,
) -> None:
    """FSDP2 in a site of one rank on NCCL under DiLoCo: the node is SIGKILLed at step
    25, the spare resumes from the step-20 checkpoint (model, optimizer and outer state
    saved as the rank's slices), and the run ends with the parameters of a fault-free
    run on the same GPU."""
    lines: list[str] = []
    finals = []
    for name, kill_at in (("cuda-fsdp-site-ref", None), ("cuda-fsdp-site-kill", 25)):
        tmp = tmp_path / name
        tmp.mkdir()
        base = sharded_job(
            name,
            tmp,
            "fsdp",
            nodes=1,
            nproc=1,
            steps=STEPS,
            every_steps=10,
            step_time=0.05,
            spares=1 if kill_at else 0,
        ).to_dict()
        base["sync"] = {"mode": "diloco", "inner_steps": 10}
        base["comm"] = {"backend": "nccl"}
        with quiet_run(load_job_data(base), lines, kill_node_at_step=kill_at) as run:
            result = run.wait()
        assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
        if kill_at:
            assert result.killed_node is not None and result.recoveries >= 1, summary(result, lines)
            assert any("resumed from" in line for line in lines), summary(result, lines)
        finals.append(assembled(tmp / "out"))
    _same(finals[1], finals[0])
    record("diloco_fsdp2_site_nccl_resume", recoveries=result.recoveries)
