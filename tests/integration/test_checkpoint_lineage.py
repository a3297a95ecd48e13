"""Retention touches only its own run's checkpoints, and never a save in progress.

Two runs of one job write to one checkpoint root (on file:// and the moto S3
server), as two people or a retried script would: run A's retention, with
``keep: 1``, leaves run B's committed checkpoint and B's save in progress
(a directory with DCP's ``.metadata.tmp`` and no manifest yet) alone, and
still removes A's own old checkpoints and A's own crashed saves.
Checkpoints written before manifests recorded a run id stay loadable and
are nobody's to delete but ``gc``'s.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from checkpoint import Checkpointer, TrainState
from checkpoint.commit import lineage_of, lineage_tag, new_token, step_dir_name
from checkpoint.fsspec_storage import Location
from orchestrator.cli import main
from tests.checkpoint_golden import GOLDEN_ROOT

pytestmark = pytest.mark.integration

RUN_A = "train-gpt/run-1/1764000000.0"
RUN_B = "train-gpt/run-1/1764000042.5"


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "file":
        return f"file://{tmp_path}/ckpt", {}
    s3 = request.getfixturevalue("s3")
    return s3.url(f"lineage-{uuid.uuid4().hex[:8]}"), s3.storage_options


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _unfinished(root: Location, step: int, run_id: str, leftover: str) -> str:
    """A save of ``run_id`` that has written objects but no manifest (yet, or ever)."""
    name = step_dir_name(step, new_token(run_id))
    root.fs.makedirs(root.path(name), exist_ok=True)
    root.fs.pipe_file(root.path(name, "__0_0.distcp"), b"partial")
    root.fs.pipe_file(root.path(name, leftover), b"partial")
    return name


def _names(ckpt: Checkpointer) -> dict[str, tuple[int, bool]]:
    return {i.name: (i.step, i.committed) for i in ckpt.list()}


def test_retention_leaves_another_runs_checkpoints_and_save_in_progress(
    target: tuple[str, dict[str, Any]],
) -> None:
    url, options = target
    a = Checkpointer(url, storage_options=options, keep=1, run_id=RUN_A)
    b = Checkpointer(url, storage_options=options, keep=1, run_id=RUN_B)
    b.save_now(25, _state())
    (b_committed,) = [n for n in _names(b) if lineage_of(n) == lineage_tag(RUN_B)]
    b_saving = _unfinished(b.root, 95, RUN_B, ".metadata.tmp")
    a_crashed = _unfinished(a.root, 30, RUN_A, "__1_0.distcp")

    for step in (50, 100, 150):
        a.save_now(step, _state())

    names = _names(a)
    assert names[b_committed] == (25, True)
    assert names[b_saving] == (95, False)
    assert a.root.fs.exists(a.root.path(b_saving, ".metadata.tmp"))
    assert a_crashed not in names  # A's own dead save is still cleaned
    mine = sorted(s for n, (s, _) in names.items() if lineage_of(n) == lineage_tag(RUN_A))
    assert mine == [150]
    latest = a.latest()
    assert latest is not None and latest.manifest is not None
    assert latest.manifest.run_id == RUN_A


def test_old_checkpoints_without_a_run_id_load_and_are_left_to_gc(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(GOLDEN_ROOT / "single", root)
    (golden,) = [p.name for p in root.iterdir() if p.name.startswith("step-")]
    url = f"file://{root}"
    ckpt = Checkpointer(url, keep=1, run_id=RUN_A)
    old = next(i for i in ckpt.list() if i.name == golden)
    assert old.committed and old.manifest is not None and old.manifest.run_id == ""
    for step in (5, 6):
        ckpt.save_now(step, _state())
    assert golden in _names(ckpt)  # another lineage: not the run's to delete

    runner = CliRunner()
    listed = runner.invoke(main, ["checkpoints", "list", url], env={"COLUMNS": "250"})
    assert listed.exit_code == 0, listed.output
    assert RUN_A in listed.output

    # gc keeps each run's newest: --run limits it to one run, and without it the
    # golden checkpoint is the newest (the only) one of its lineage.
    result = runner.invoke(main, ["checkpoints", "gc", url, "--keep", "1", "--run", RUN_A])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["checkpoints", "gc", url, "--keep", "1"])
    assert result.exit_code == 0, result.output
    assert sorted(s for s, _ in _names(ckpt).values()) == [2, 6]
