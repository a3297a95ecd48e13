"""A job file takes snake_case (its own spelling) or camelCase (the TrainingJob's)."""

from __future__ import annotations

import pytest

from orchestrator.spec.api import SpecError
from orchestrator.spec.loader import load_job_text

pytestmark = pytest.mark.unit

SNAKE = """
name: j
entrypoint: {script: t.py}
nproc_per_node: 2
max_steps: 50
checkpoint: {every_steps: 10, async: false}
fault_tolerance: {hang_timeout: 1m, preemption_grace: 20s}
comm: {hierarchical: true, compression: {type: topk, inter_node_only: true, warmup_steps: 5}}
"""


def test_both_spellings_give_the_same_spec() -> None:
    snake = SNAKE
    camel = (
        snake.replace("nproc_per_node", "nprocPerNode")
        .replace("max_steps", "maxSteps")
        .replace("every_steps", "everySteps")
        .replace("fault_tolerance", "faultTolerance")
        .replace("hang_timeout", "hangTimeout")
        .replace("preemption_grace", "preemptionGrace")
        .replace("inter_node_only", "interNodeOnly")
        .replace("warmup_steps", "warmupSteps")
    )
    assert "_" not in camel.replace("t.py", "")
    assert load_job_text(camel) == load_job_text(snake)


def test_environment_names_are_user_data_not_keys() -> None:
    spec = load_job_text("name: j\nentrypoint: {script: t.py, env: {NCCL_DEBUG: WARN}}\n")
    assert spec.entrypoint.env == {"NCCL_DEBUG": "WARN"}


def test_one_field_in_both_spellings_is_an_error() -> None:
    with pytest.raises(SpecError) as caught:
        load_job_text("name: j\nentrypoint: {script: t.py}\nmax_steps: 5\nmaxSteps: 6\n")
    (problem,) = caught.value.problems
    assert problem.path == "maxSteps" and problem.line == 4
    assert problem.message == "is given twice (also as 'max_steps'); keep one"


def test_problems_are_named_in_the_files_spelling() -> None:
    text = (
        "name: j\nentrypoint: {script: t.py}\n"
        "faultTolerance: {hangTimeout: 5s, heartbeatInterval: 10s}\n"
        "checkpoint: {everyStep: 3}\n"
    )
    with pytest.raises(SpecError) as caught:
        load_job_text(text)
    found = {p.path: p.message for p in caught.value.problems}
    assert "heartbeat_interval (10s) must be shorter" in found["faultTolerance.heartbeatInterval"]
    assert found["checkpoint.everyStep"].startswith(
        "unknown key 'everyStep'; did you mean 'everySteps'?"
    )
    assert (
        "known keys here: url, everySteps, everySeconds, keep, async"
        in found["checkpoint.everyStep"]
    )
