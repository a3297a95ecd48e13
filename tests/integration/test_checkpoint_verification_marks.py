"""A checkpoint that failed verification is marked beside it and counted by nobody.

On file:// and the moto S3 server: retention with ``keep: N`` never deletes a
valid checkpoint while counting a bit-flipped one among the N; a restore that
finds a flipped byte marks the checkpoint, and later restores, retention,
``resume`` and ``checkpoints list`` all see the mark; ``checkpoints verify``
of a repaired checkpoint clears it.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from checkpoint import Checkpointer, CheckpointNotFoundError, RestoreSource, TrainState
from checkpoint.api import FAILED_MARKER, CheckpointInfo, Verification
from checkpoint.catalog import resume_point
from checkpoint.commit import latest_committed, list_checkpoints
from orchestrator.cli import main

pytestmark = pytest.mark.integration


@pytest.fixture(params=["file", "s3"])
def target(
    request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict[str, Any]]:
    """A fresh checkpoint root URL and its storage options; the CLI reaches S3 by env."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt", {}
    s3 = request.getfixturevalue("s3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    return s3.url(f"marks-{uuid.uuid4().hex[:8]}"), s3.storage_options


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _by_step(ckpt: Checkpointer) -> dict[int, CheckpointInfo]:
    return {i.step: i for i in ckpt.list()}


def _flip_a_byte(ckpt: Checkpointer, step: int) -> bytes:
    """Flip one bit in a data object of ``step``'s checkpoint; returns the original bytes."""
    info = _by_step(ckpt)[step]
    assert info.manifest is not None
    victim = next(o.path for o in info.manifest.objects if o.path.endswith(".distcp"))
    path = ckpt.root.path(info.name, victim)
    original = ckpt.root.fs.cat_file(path)
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    ckpt.root.fs.pipe_file(path, bytes(data))
    return original


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "250"})


def test_retention_never_trades_a_valid_checkpoint_for_a_corrupt_one(
    target: tuple[str, dict[str, Any]],
) -> None:
    url, options = target
    ckpt = Checkpointer(url, storage_options=options, keep=3)
    for step in (10, 20, 30):
        ckpt.save_now(step, _state())
    _flip_a_byte(ckpt, 20)

    # A fourth save: the three kept in place of step 10 are read back first;
    # step 20 fails, is marked and not counted, so step 10 stays.
    ckpt.save_now(40, _state())
    infos = _by_step(ckpt)
    assert sorted(infos) == [10, 20, 30, 40]
    assert infos[20].verification is Verification.FAILED and not infos[20].usable
    assert ckpt.root.fs.exists(ckpt.root.path(infos[20].name, FAILED_MARKER))  # not deleted
    assert all(infos[s].verification is Verification.VERIFIED for s in (10, 30, 40))

    # The next save: step 10 goes (three sound ones are newer), and so does the
    # corrupt step 20, now older than every checkpoint kept.
    ckpt.save_now(50, _state())
    assert sorted(_by_step(ckpt)) == [30, 40, 50]


def test_a_failed_restore_marks_the_checkpoint_for_everyone_after(
    target: tuple[str, dict[str, Any]],
) -> None:
    url, options = target
    ckpt = Checkpointer(url, storage_options=options, keep=5)
    ckpt.save_now(10, _state())
    ckpt.save_now(20, _state())
    original = _flip_a_byte(ckpt, 20)
    bad = _by_step(ckpt)[20]

    result = Checkpointer(url, storage_options=options).restore(_state(seed=1))
    assert result.source is RestoreSource.DURABLE and result.step == 10
    assert [s.split(":")[0] for s in result.skipped] == [bad.name]
    infos = _by_step(ckpt)
    assert infos[20].verification is Verification.FAILED
    assert infos[10].verification is Verification.VERIFIED

    # From now on nobody counts it: discovery, the next restore, resume.
    newest = latest_committed(ckpt.root)
    assert newest is not None and newest.step == 10
    again = Checkpointer(url, storage_options=options).restore(_state(seed=2))
    assert again.step == 10 and again.skipped == ()
    assert resume_point(url, options).step == 10
    with pytest.raises(CheckpointNotFoundError, match="failed verification"):
        resume_point(bad.url, options)

    listed = _cli("checkpoints", "list", url)
    assert listed.exit_code == 0, listed.output
    rows = {line.split("│")[0].strip(): line for line in listed.output.splitlines()}
    assert "failed verification: " in rows["20"] and "checksum" in rows["20"]
    assert "│ verified" in rows["10"]

    # Repaired (the original bytes back), `checkpoints verify` clears the mark.
    info = _by_step(ckpt)[20]
    assert info.manifest is not None
    victim = next(o.path for o in info.manifest.objects if o.path.endswith(".distcp"))
    ckpt.root.fs.pipe_file(ckpt.root.path(info.name, victim), original)
    verified = _cli("checkpoints", "verify", bad.url)
    assert verified.exit_code == 0, verified.output
    assert _by_step(ckpt)[20].verification is Verification.VERIFIED
    assert resume_point(url, options).step == 20


def test_list_is_cheap_by_default_and_reads_everything_with_verify(
    target: tuple[str, dict[str, Any]],
) -> None:
    url, options = target
    ckpt = Checkpointer(url, storage_options=options, keep=5)
    for step in (1, 2):
        ckpt.save_now(step, _state())
    _flip_a_byte(ckpt, 1)

    plain = _cli("checkpoints", "list", "--json", url)
    assert plain.exit_code == 0, plain.output
    assert plain.output.count('"verification": "not verified"') == 2

    checked = _cli("checkpoints", "list", "--verify", url)
    assert checked.exit_code == 0, checked.output
    rows = {line.split("│")[0].strip(): line for line in checked.output.splitlines()}
    assert "failed verification" in rows["1"]
    assert "│ verified" in rows["2"]
    assert [i.verification for i in list_checkpoints(ckpt.root)] == [
        Verification.FAILED,
        Verification.VERIFIED,
    ]
