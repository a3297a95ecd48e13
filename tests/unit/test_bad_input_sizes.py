"""Absurd sizes are refused where the job is written, with the bound and its reason.

``nproc_per_node: 100000000``, ``nodes.max: 10**12`` and ``max_steps: 10**29``
once passed ``validate`` and ``submit``, and an agent then started workers
until etcd stopped answering.  Each is now one problem naming the field, the
largest valid value and why; the bounds themselves stay valid.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.spec.api import SpecError
from orchestrator.spec.bounds import INT64_MAX, MAX_NODES, MAX_NPROC_PER_NODE
from orchestrator.spec.job import EntrypointSpec, JobSpec, NodesSpec
from orchestrator.spec.loader import load_job_text

pytestmark = pytest.mark.unit

ABSURD = """\
name: demo
entrypoint: train.py
nproc_per_node: 100000000
nodes: {min: 1, max: 1000000000000}
max_steps: 100000000000000000000000000000
"""


def _problems(text: str) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        load_job_text(text, "job.yaml")
    return {p.path: p.message for p in err.value.problems}


def test_each_absurd_size_is_one_problem_with_its_bound_and_reason() -> None:
    found = _problems(ABSURD)
    assert set(found) == {"nproc_per_node", "nodes.max", "max_steps"}
    assert found["nproc_per_node"].startswith("must be at most 1,024, got 100,000,000: ")
    assert "worker process" in found["nproc_per_node"]
    assert found["nodes.max"].startswith("must be at most 8,192, got 1,000,000,000,000: ")
    assert "etcd" in found["nodes.max"]
    assert "64-bit integer" in found["max_steps"] and str(f"{INT64_MAX:,}") in found["max_steps"]


def test_spares_count_towards_the_node_bound() -> None:
    found = _problems(f"name: demo\nentrypoint: t.py\nnodes: {{max: {MAX_NODES}, spares: 1}}\n")
    assert found["nodes.max"].startswith(f"must be at most 8,192, got {MAX_NODES + 1:,}")


def test_an_integer_past_int64_anywhere_is_refused() -> None:
    found = _problems(f"name: demo\nentrypoint: t.py\ncheckpoint: {{every_steps: {10**60}}}\n")
    assert found["checkpoint.every_steps"].endswith("got a number of 61 digits")


def test_the_bounds_themselves_are_valid() -> None:
    spec = load_job_text(
        f"name: demo\nentrypoint: t.py\nnproc_per_node: {MAX_NPROC_PER_NODE}\n"
        f"nodes: {{max: {MAX_NODES}}}\nmax_steps: {INT64_MAX}\n"
    )
    assert spec.nproc_per_node == MAX_NPROC_PER_NODE and spec.max_steps == INT64_MAX


def test_a_spec_built_in_code_is_bounded_too() -> None:
    spec = JobSpec(
        "demo", EntrypointSpec(script="t.py"), nodes=NodesSpec(max=10**12), nproc_per_node=10**8
    )
    with pytest.raises(SpecError) as err:
        spec.validate()
    assert {p.path for p in err.value.problems} == {"nodes.max", "nproc_per_node"}


@pytest.mark.parametrize("command", [["validate"], ["submit", "--etcd", "127.0.0.1:9"]])
def test_validate_and_submit_refuse_them(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "job.yaml").write_text(ABSURD)
    result = CliRunner().invoke(main, [*command, "job.yaml"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "job.yaml:3: nproc_per_node: must be at most 1,024" in result.output
    assert "job.yaml:4: nodes.max: must be at most 8,192" in result.output
    assert "job.yaml:5: max_steps: must be between" in result.output
