"""The node agent's limit on workers per node: the node's CPUs, or its GPUs on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.node.capacity import capacity_problem, uses_cuda, visible_gpus
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data

pytestmark = pytest.mark.unit


def _spec(nproc: int, **more: object) -> JobSpec:
    return load_job_data(
        {"name": "cap", "entrypoint": {"script": "t.py"}, "nproc_per_node": nproc, **more}
    )


@pytest.mark.parametrize(
    ("spec", "cpus", "gpus", "in_process", "limit"),
    [
        (_spec(4), 4, 0, True, None),  # as many as CPUs
        (_spec(5), 4, 0, True, "at most 4"),
        (_spec(5), 4, 0, True, "the 4 CPUs it may use"),
        (_spec(2), 16, 1, True, "the 1 GPU it shows"),  # the runtime binds a GPU per rank
        (_spec(2), 16, 1, False, None),  # a torchrun script that asks for no GPU: CPUs count
        (_spec(2, comm={"backend": "nccl"}), 16, 1, False, "at most 1"),
        (_spec(2, resources={"gpus": 1}), 16, 1, False, "at most 1"),
        (_spec(8, comm={"backend": "nccl"}), 16, 8, True, None),
        (_spec(3, comm={"backend": "nccl"}), 2, 0, True, "2 CPUs"),  # no GPU seen: CPUs count
        (_spec(1024, oversubscribe=True), 2, 0, True, None),  # forced
    ],
)
def test_nproc_per_node_against_the_node(
    spec: JobSpec, cpus: int, gpus: int, in_process: bool, limit: str | None
) -> None:
    problem = capacity_problem(spec, "n1", cpus, gpus, in_process)
    if limit is None:
        assert problem is None
        return
    assert problem is not None and limit in problem
    assert problem.startswith(f"node n1: nproc_per_node ({spec.nproc_per_node:,}) is more than")
    assert "`oversubscribe: true` in the job file" in problem and "\n" not in problem


def test_uses_cuda() -> None:
    assert not uses_cuda(_spec(1), 0, True)
    assert uses_cuda(_spec(1), 2, True) and not uses_cuda(_spec(1), 2, False)


def test_visible_gpus_from_the_environment_or_the_driver(tmp_path: Path) -> None:
    driver = tmp_path / "gpus"
    driver.mkdir()
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (driver / bus).mkdir()
    assert visible_gpus({}, driver) == 3
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, driver) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, driver) == 0
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,0"}, driver) == 1  # CUDA stops at -1
    assert visible_gpus({}, tmp_path / "no-driver") == 0


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_oversubscribed_gpus_are_shared_on_gloo_only(backend: str) -> None:
    """NCCL takes one worker per GPU: the workers past the GPUs would fail to start
    and the others wait for them, so the agent refuses at once."""
    spec = _spec(2, oversubscribe=True, comm={"backend": backend})
    problem = capacity_problem(spec, "n1", 16, 1, True)
    assert problem is not None and "NCCL takes one worker per GPU" in problem, problem
    assert "set comm.backend: gloo" in problem and "\n" not in problem
    gloo = _spec(2, oversubscribe=True, comm={"backend": "gloo"})
    assert capacity_problem(gloo, "n1", 16, 1, True) is None
