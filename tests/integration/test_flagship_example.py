"""The flagship example (examples/lm.yaml, short form) survives a node kill unchanged.

Two real local runs of the byte-level transformer LM: one without failures
and one with a node SIGKILLed mid-run while a warm spare waits.  The example
trains under bf16 autocast, accumulates gradients with ``no_sync``, reads its
data through the elastic loader with two worker processes, tracks EMA weights
and a token counter, and saves asynchronous durable checkpoints.  The killed
run must really recover (one recovery, the spare in the dead node's place)
and end, on every rank, with the same losses (within 1e-5), EMA and token
count as the run without failures: a replacement received every tracked
object and read the same batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.api import JobPhase
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from tests.chaos.jobs import REPO, quiet_run, summary

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 28  # saves due at 8, 16, 24: at least two commit
KILL_AT = 8


def short_lm_job(name: str, tmp: Path, spares: int, example: str = "lm.yaml") -> JobSpec:
    """examples/lm.yaml (or ``example``) in its short form, with its output and
    checkpoints under ``tmp``."""
    data: dict[str, Any] = yaml.safe_load((REPO / "examples" / example).read_text())
    data["name"] = name
    data["entrypoint"]["script"] = str(REPO / data["entrypoint"]["script"])
    data["entrypoint"]["args"] += ["--short", "--warmup", "4", "--out", str(tmp / "out")]
    data["entrypoint"]["env"] = {"RINGMASTER_LM_SHORT": "1"}
    data["nodes"]["spares"] = spares
    data["max_steps"] = STEPS
    data["checkpoint"] = {"url": f"file://{tmp}/ckpt", "every_steps": 8}
    data["fault_tolerance"]["heartbeat_interval"] = "500ms"
    return load_job_data(data)


def finals(tmp: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((tmp / "out").glob("final-rank*.json"))]


def test_lm_example_ends_with_the_same_loss_after_a_node_kill(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    ref_dir.mkdir()
    run_dir.mkdir()
    lines: list[str] = []
    with quiet_run(short_lm_job("lm-reference", ref_dir, spares=0), lines) as run:
        reference = run.wait()
    assert reference.phase is JobPhase.SUCCEEDED, summary(reference, lines)
    assert reference.recoveries == 0
    ref = finals(ref_dir)
    assert len(ref) == 2 and all(r["step"] == STEPS for r in ref)
    assert ref[0]["eval_loss"] < 5.0, "the model learned nothing (ln 256 = 5.55)"
    checkpoints = [e for e in reference.events if e.type == "Checkpoint"]
    # async saves: one still uploading when the next falls due is skipped, not waited for
    assert len(checkpoints) >= 2, "periodic async checkpoints were not committed"

    lines = []
    spec = short_lm_job("lm-killed", run_dir, spares=1)
    with quiet_run(spec, lines, kill_node_at_step=KILL_AT) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.killed_node is not None and result.recoveries == 1, summary(result, lines)
    kinds = [e.type for e in result.events]
    assert "NodeFailed" in kinds and "Recovered" in kinds, kinds
    generations = [e for e in result.events if e.type == "Generation"]
    assert len(generations) == 2 and "replaces" in generations[1].message
    got = finals(run_dir)
    assert len(got) == 2
    assert any(g["recoveries"] == 0 for g in got), "the replacement never trained"
    for rank, (mine, theirs) in enumerate(zip(got, ref, strict=True)):
        # held-out losses are of the final weights; the last step's loss is of the rank's share
        for key in ("eval_loss", "ema_eval_loss", "train_loss"):
            assert abs(mine[key] - theirs[key]) <= 1e-5, f"rank {rank} {key}: {mine} vs {theirs}"
        assert mine["tokens"] == theirs["tokens"] and mine["step"] == STEPS


# short form: the LM's node kill above; tensor parallel: chaos/test_sharded_recovery.py
@pytest.mark.long
def test_tensor_parallel_lm_ends_with_the_same_loss_after_a_node_kill(tmp_path: Path) -> None:
    """examples/lm_mesh.yaml: 2 replicas x tensor 2; the killed node's slices come from
    its twins and the run ends with the uninterrupted run's losses."""
    losses = {}
    for name, spares, kill in (("reference", 0, None), ("killed", 1, KILL_AT)):
        out = tmp_path / name
        out.mkdir()
        lines: list[str] = []
        spec = short_lm_job(f"lm-mesh-{name}", out, spares, "lm_mesh.yaml")
        with quiet_run(spec, lines, kill_node_at_step=kill) as run:
            result = run.wait()
        assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
        assert result.recoveries == (0 if kill is None else 1), summary(result, lines)
        got = finals(out)
        assert len(got) == 4 and all(g["step"] == STEPS for g in got), got
        losses[name] = got
        if kill is not None:
            recovered = [e for e in result.events if e.type == "Recovered"]
            assert "state from twin, 0 steps lost" in recovered[0].message, recovered
    assert losses["reference"][0]["eval_loss"] < 5.0, "the model learned nothing (ln 256 = 5.55)"
    for rank, (mine, theirs) in enumerate(zip(losses["killed"], losses["reference"], strict=True)):
        for key in ("eval_loss", "train_loss"):
            assert abs(mine[key] - theirs[key]) <= 1e-5, f"rank {rank} {key}: {mine} vs {theirs}"
