"""Where a restart-tier script keeps its own checkpoint: read from its source, said by `validate`.

The scripts are shaped like the public torchrun examples a new user brings
(the DDP tutorial's ``snapshot.pt`` beside the script, an ``argparse``
``--checkpoint-dir``, a path in a config file read at run time).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.checkpoint_root import reach as checkpoint_reach
from orchestrator.checkpoint_root.reach import Reach, script_checkpoint, script_storage
from orchestrator.checkpoint_root.script_checkpoint import find_saves
from orchestrator.cli import main
from orchestrator.spec.loader import load_job_data

pytestmark = pytest.mark.unit

#: The DDP tutorial's multinode script, cut to what decides where it saves.
TUTORIAL = """\
import os
import torch
from torch.distributed import init_process_group


class Trainer:
    def __init__(self, model, save_every: int, snapshot_path: str) -> None:
        self.model = model
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path)
        self.epochs_run = snapshot["EPOCHS_RUN"]

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)


def main(save_every: int, total_epochs: int, snapshot_path: str = "snapshot.pt"):
    init_process_group(backend="gloo")
    Trainer(None, save_every, snapshot_path)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    args = parser.parse_args()
    main(args.save_every, args.total_epochs)
"""

ARGPARSE = """\
import argparse, os
from pathlib import Path
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", default="checkpoints/run")
args = parser.parse_args()
ckpt_dir = Path(os.environ.get("MY_CKPT") or args.checkpoint_dir)


def save(directory, state, step):
    final = directory / f"ckpt-{step:08d}.pt"
    torch.save(state, final.with_suffix(".tmp"))


save(ckpt_dir, {}, 1)
"""


def _spec(script: str, **more: object) -> object:
    return load_job_data(
        {
            "name": "demo",
            "entrypoint": {"script": script, **more},
            "fault_tolerance": {"recovery": "restart"},
        }
    )


def _validate(tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    (tmp_path / "job.yaml").write_text(job)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["validate", "job.yaml"])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_validate_says_a_relative_snapshot_is_not_seen_by_every_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "multinode.py").write_text(TUTORIAL)
    job = "name: demo\nentrypoint: {script: multinode.py, args: ['50', '10']}\n"
    lines = _validate(tmp_path, job, monkeypatch)
    assert lines[2] == (
        "checkpoint: snapshot.pt (torch.save in multinode.py line 20): a path relative to "
        "the directory each agent starts in"
    )
    assert lines[3].startswith(
        "warning: a node whose agent starts in another directory or on another machine finds "
        "no checkpoint there and would train from zero after a failure, so the job fails at "
        "its start when its nodes are in different places"
    )
    assert "$RINGMASTER_CHECKPOINT_DIR" in lines[3]


def test_validate_says_when_it_cannot_tell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # minGPT-DDP: the path comes from a config file at run time, through a dataclass
    (tmp_path / "trainer.py").write_text(
        "import torch\nfrom dataclasses import dataclass\n\n@dataclass\nclass Config:\n"
        "    snapshot_path: str = None\n\nclass Trainer:\n    def __init__(self, config):\n"
        "        self.config = config\n    def save(self):\n"
        "        torch.save({}, self.config.snapshot_path)\n"
    )
    (tmp_path / "main.py").write_text(
        "from trainer import Trainer, Config\nTrainer(Config(**load_yaml()))\n"
    )
    lines = _validate(tmp_path, "name: demo\nentrypoint: main.py\n", monkeypatch)
    assert lines[2].startswith(
        "checkpoint: cannot tell: torch.save in trainer.py line 12 saves to "
        "{self.config.snapshot_path}, a path known only when the script runs"
    )
    (tmp_path / "main.py").write_text("print('no checkpoint at all')\n")
    lines = _validate(tmp_path, "name: demo\nentrypoint: main.py\n", monkeypatch)
    assert lines[2].startswith("checkpoint: cannot tell: no torch.save")
    # the in-process tier keeps ringmaster's own checkpoints: nothing to say
    (tmp_path / "main.py").write_text("from agents import runtime\n")
    assert not any(
        x.startswith("checkpoint:")
        for x in _validate(tmp_path, "name: demo\nentrypoint: main.py\n", monkeypatch)
    )


def test_an_argparse_default_is_overridden_by_the_jobs_args(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(ARGPARSE)
    shown = sorted(s.shown for s in find_saves(script))
    assert shown == ["$MY_CKPT/ckpt-{step}.pt", "checkpoints/run/ckpt-{step}.pt"]
    given = find_saves(script, ["--checkpoint-dir", "/shared/x"])
    assert sorted(s.shown for s in given) == ["$MY_CKPT/ckpt-{step}.pt", "/shared/x/ckpt-{step}.pt"]
    # a variable the job does not set is not there: the argparse value decides
    found = script_checkpoint(_spec(str(script), args=["--checkpoint-dir", "run-a"]), tmp_path)
    assert found.reach is Reach.RELATIVE and found.where.startswith("run-a/ckpt-{step}.pt")
    found = script_checkpoint(_spec(str(script), env={"MY_CKPT": "s3://bucket/ck"}), tmp_path)
    assert found.reach is Reach.SHARED and found.warning is None
    assert found.where.startswith("s3://bucket/ck/ckpt-{step}.pt (torch.save in train.py")


def test_ringmasters_directory_is_judged_by_checkpoint_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    script.write_text(ARGPARSE.replace('"MY_CKPT"', '"RINGMASTER_CHECKPOINT_DIR"'))
    spec = _spec(str(script))
    spec.checkpoint.url = "s3://bucket/jobs/demo"
    found = script_checkpoint(spec, tmp_path)
    assert found.reach is Reach.SHARED and found.warning is None
    assert "$RINGMASTER_CHECKPOINT_DIR being s3://bucket/jobs/demo/script" in found.where
    spec.checkpoint.url = f"file://{tmp_path}/ck"
    monkeypatch.setattr(checkpoint_reach, "filesystem_type", lambda path: "nfs4")
    assert script_checkpoint(spec, tmp_path).reach is Reach.SHARED
    monkeypatch.setattr(checkpoint_reach, "filesystem_type", lambda path: "ext4")
    local = script_checkpoint(spec, tmp_path)
    assert local.reach is Reach.ONE_MACHINE and "only agents on this machine" in str(local.warning)
    # `ringmaster run`: every agent runs on this machine, in one directory
    assert script_checkpoint(spec, tmp_path, one_machine=True).warning is None
    spec.checkpoint.url = "file://./ck"
    assert script_checkpoint(spec, tmp_path).reach is Reach.RELATIVE
    assert script_checkpoint(spec, tmp_path, one_machine=True).warning is None


def test_each_agent_says_where_it_sees_the_checkpoint(tmp_path: Path) -> None:
    """What an agent registers (``NodeRecord.script_storage``): two directories, two places;
    one directory (also through a symlink), one place; object storage: nothing to compare."""
    script = tmp_path / "multinode.py"
    script.write_text(TUTORIAL)
    spec = _spec(str(script), args=["50", "10"])
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (tmp_path / "link").symlink_to(a)
    host = socket.gethostname()
    assert script_storage(spec, a) == f"{host}:{a.resolve()}/snapshot.pt"
    assert script_storage(spec, b) != script_storage(spec, a)
    assert script_storage(spec, tmp_path / "link") == script_storage(spec, a)
    argparse_script = tmp_path / "train.py"
    argparse_script.write_text(ARGPARSE)
    on_s3 = _spec(str(argparse_script), env={"MY_CKPT": "s3://bucket/ck"})
    assert script_storage(on_s3, a) is None
