"""`ringmaster run job.yaml --from URL` / `--resume`: real runs resume committed checkpoints.

A job with top-k gradient compression trains at world size 2 and commits
checkpoints (with each rank's comm hook state).  Two more runs start from it
through the real CLI, each with a real controller, node agents and workers:

* at world size 1, the state is resharded and the hook starts fresh (logged);
* at world size 2, every rank gets its own hook state back, so the hook's
  step counter continues from the checkpoint instead of restarting.

The hook state is read back from the checkpoints each run committed.
``run --resume`` continues a job from its own checkpoint root, and refuses
before starting when there is nothing to resume.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from checkpoint.commit import latest_committed, list_checkpoints
from checkpoint.durable import load_into
from checkpoint.flat_state import _from_bytes, rank_key
from checkpoint.fsspec_storage import Location
from checkpoint.groups import Coordination
from orchestrator.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


def _job_file(tmp: Path, name: str, nodes: int, steps: int) -> Path:
    spec = {
        "name": name,
        "entrypoint": {
            "script": str(REPO / "examples" / "train_tiny.py"),
            "env": {"RINGMASTER_LOG_EVERY": "1000"},
        },
        "nodes": {"min": nodes, "max": nodes},
        "max_steps": steps,
        "checkpoint": {"url": f"file://{tmp}/{name}", "every_steps": 10, "async": False},
        "comm": {"compression": {"type": "topk", "ratio": 0.25, "warmup_steps": 3}},
        "fault_tolerance": {"hang_timeout": "30s", "heartbeat_interval": "500ms"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(etcd: Any, job_file: Path, *extra: str) -> str:
    result = CliRunner().invoke(
        main, ["run", str(job_file), "--etcd", etcd.endpoint, "--timeout", "150", *extra]
    )
    assert result.exit_code == 0, result.output[-4000:]
    return result.output


def _hook_states(root_url: str) -> tuple[int, dict[int, dict[str, Any]]]:
    """(step, {rank: saved comm hook entry}) of the newest committed checkpoint."""
    root = Location.from_url(root_url)
    info = latest_committed(root)
    assert info is not None and info.manifest is not None
    world = info.manifest.world_size
    target: dict[str, Any] = {rank_key(r): b"" for r in range(world)}
    load_into(root.child(info.name), target, Coordination(None))
    states = {r: _from_bytes(target[rank_key(r)])["state"]["comm_hook"] for r in range(world)}
    return info.step, states


def test_run_from_reshards_and_carries_hook_state_at_the_same_world_size(
    etcd: Any, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    first = f"first-{tag}"
    _run(etcd, _job_file(tmp_path, first, nodes=2, steps=20))
    step, saved = _hook_states(f"file://{tmp_path}/{first}")
    assert step == 20
    assert sorted(saved) == [0, 1]
    assert all(s["world_size"] == 2 and s["state"]["step"] == 20 for s in saved.values())

    # World size 1: resharded from 2, hook state dropped and said so.
    smaller = f"smaller-{tag}"
    out = _run(
        etcd,
        _job_file(tmp_path, smaller, nodes=1, steps=30),
        "--from",
        f"file://{tmp_path}/{first}",
    )
    assert "resumes from step 20" in out and "resharded from 2 to up to 1 ranks" in out
    assert "saved by 2 ranks, now 1: the comm hook starts fresh" in out
    step, saved = _hook_states(f"file://{tmp_path}/{smaller}")
    assert step == 30
    assert saved[0]["world_size"] == 1 and saved[0]["state"]["step"] == 10  # fresh at step 20

    # World size 2 again: each rank's hook continues where the checkpoint left it.
    same = f"same-{tag}"
    out = _run(
        etcd, _job_file(tmp_path, same, nodes=2, steps=30), "--from", f"file://{tmp_path}/{first}"
    )
    assert "resumes from step 20" in out and "resharded" not in out
    assert out.count("comm hook state restored from the checkpoint") == 2
    step, saved = _hook_states(f"file://{tmp_path}/{same}")
    assert step == 30
    assert all(s["state"]["step"] == 30 for s in saved.values())  # 20 restored + 10 run


def test_run_from_refuses_a_missing_checkpoint_before_starting(etcd: Any, tmp_path: Path) -> None:
    job = _job_file(tmp_path, f"nothing-{uuid.uuid4().hex[:6]}", nodes=1, steps=5)
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(
        main, ["run", str(job), "--etcd", etcd.endpoint, "--from", str(tmp_path / "empty")]
    )
    assert result.exit_code == 1
    assert "no committed checkpoint under" in result.output
    assert "[run] submitted" not in result.output


def test_run_resume_continues_the_jobs_own_checkpoints(etcd: Any, tmp_path: Path) -> None:
    name = f"again-{uuid.uuid4().hex[:6]}"
    job = _job_file(tmp_path, name, nodes=1, steps=10)

    # No checkpoint yet: refused before anything starts.
    refused = CliRunner().invoke(main, ["run", str(job), "--etcd", etcd.endpoint, "--resume"])
    assert refused.exit_code == 1
    assert f"cannot resume job '{name}'" in refused.output and "does not exist" in refused.output
    assert "[run] submitted" not in refused.output

    both = CliRunner().invoke(
        main, ["run", str(job), "--etcd", etcd.endpoint, "--resume", "--from", str(tmp_path)]
    )
    assert both.exit_code == 2 and "not both" in both.output

    _run(etcd, job)
    longer = _job_file(tmp_path, name, nodes=1, steps=20)
    out = _run(etcd, longer, "--resume")
    assert "resumes from step 10" in out
    step, _ = _hook_states(f"file://{tmp_path}/{name}")
    assert step == 20


def test_run_resume_over_a_corrupt_newest_checkpoint_names_it(etcd: Any, tmp_path: Path) -> None:
    """The newest committed checkpoint's data damaged after the run: ``--resume`` does
    not end in worker tracebacks; the corrupt checkpoint is named and marked, and the job
    goes on from the newest one that verifies."""
    name = f"corrupt-{uuid.uuid4().hex[:6]}"
    _run(etcd, _job_file(tmp_path, name, nodes=1, steps=20))
    root = Location.from_url(f"file://{tmp_path}/{name}")
    newest = latest_committed(root)
    assert newest is not None and newest.step == 20
    data = [
        p
        for p in (tmp_path / name / newest.name).rglob("*")
        if p.is_file() and p.suffix != ".json" and p.stat().st_size > 64
    ]
    assert data, list((tmp_path / name / newest.name).rglob("*"))
    damaged = bytearray(data[0].read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data[0].write_bytes(bytes(damaged))
    out = _run(etcd, _job_file(tmp_path, name, nodes=1, steps=30), "--resume")
    assert "Traceback" not in out, out[-4000:]
    passed = [x for x in out.splitlines() if x.startswith("[event] CheckpointPassedOver:")]
    assert len(passed) == 1 and newest.name in passed[0], out[-4000:]
    assert "the job resumes from the newest one that verifies" in passed[0], passed
    assert "resumed from" in out and "at step 10" in out, out[-4000:]
    step, _ = _hook_states(f"file://{tmp_path}/{name}")
    assert step == 30
    assert latest_committed(root) is not None and not [  # the damaged one is marked
        c for c in list_checkpoints(root) if c.name == newest.name and c.usable
    ]
