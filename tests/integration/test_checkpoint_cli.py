"""`ringmaster checkpoints list|verify|gc` and `ringmaster resume`, through the real CLI.

Checkpoints are written by a real :class:`Checkpointer` to file:// and to the
moto S3 server over HTTP; the CLI reaches S3 the way a user's shell does,
through ``AWS_*`` environment variables.  ``resume`` runs against the real
etcd fixture and is checked by what it stores for the workers.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from checkpoint import Checkpointer, TrainState
from checkpoint.commit import list_checkpoints, step_dir_name
from checkpoint.fsspec_storage import Location
from orchestrator.api import JobPhase
from orchestrator.checkpoint_root.writer_hold import MarkerStore
from orchestrator.checkpoint_root.writer_marker import WriterMarker
from orchestrator.cli import main
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs, keys, records

pytestmark = pytest.mark.integration

SECRET = "testing"  # what moto accepts; it must never be printed


@pytest.fixture(params=["file", "s3"])
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict[str, Any]]:
    """(root URL, storage options) per backend; the CLI gets S3 through the environment."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt", {}
    s3 = request.getfixturevalue("s3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret)
    return s3.url(f"cli-{uuid.uuid4().hex[:8]}"), s3.storage_options


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), samples_seen=64)


def _save(url: str, options: dict[str, Any], steps: list[int], **kw: Any) -> Checkpointer:
    ckpt = Checkpointer(url, storage_options=options, keep=10, **kw)
    for step in steps:
        ckpt.save_now(step, _state())
    return ckpt


def _dead(root: Location, step: int) -> str:
    """A directory left by a save that crashed before its manifest."""
    name = step_dir_name(step, "dead0001")
    root.fs.makedirs(root.path(name), exist_ok=True)
    root.fs.pipe_file(root.path(name, "__0_0.distcp"), b"partial")
    return name


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "250"})


def test_list_shows_committed_and_uncommitted(backend: tuple[str, dict[str, Any]]) -> None:
    url, options = backend
    ckpt = _save(url, options, [10, 20])
    dead = _dead(ckpt.root, 30)
    result = _cli("checkpoints", "list", url)
    assert result.exit_code == 0, result.output
    rows = [
        [cell.strip() for cell in line.strip("│ ").split("│")]
        for line in result.output.splitlines()
        if "step-" in line
    ]
    # step, size, time, world, status, directory
    assert [(r[0], r[3], r[4]) for r in rows] == [
        ("10", "1", "not verified"),
        ("20", "1", "not verified"),
        ("30", "-", "not committed: no manifest (never committed)"),
    ]
    assert rows[0][1].endswith("KiB") and rows[0][2].startswith("20")
    assert rows[2][5] == dead


def test_verify_passes_then_names_the_damaged_object(backend: tuple[str, dict[str, Any]]) -> None:
    url, options = backend
    ckpt = _save(url, options, [5])
    result = _cli("checkpoints", "verify", url)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("OK:")

    info = ckpt.latest()
    assert info is not None and info.manifest is not None
    victim = next(o.path for o in info.manifest.objects if o.path.endswith(".distcp"))
    path = ckpt.root.path(info.name, victim)
    data = bytearray(ckpt.root.fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    ckpt.root.fs.pipe_file(path, bytes(data))

    result = _cli("checkpoints", "verify", info.url)
    assert result.exit_code == 1
    assert f"bad object in {info.url}: {victim}: checksum" in result.output


def test_gc_keeps_the_newest_and_removes_dead_directories(
    backend: tuple[str, dict[str, Any]],
) -> None:
    url, options = backend
    ckpt = _save(url, options, [1, 2, 3])
    old_dead, new_dead = _dead(ckpt.root, 2), _dead(ckpt.root, 9)

    result = _cli("checkpoints", "gc", url, "--keep", "1")
    assert result.exit_code == 0, result.output
    assert f"removed uncommitted {old_dead}" in result.output
    remaining = [(i.step, i.committed) for i in list_checkpoints(ckpt.root)]
    # The newer dead directory may be a save in progress: it stays without --include-newer.
    assert remaining == [(3, True), (9, False)]

    result = _cli("checkpoints", "gc", url, "--keep", "1", "--include-newer")
    assert result.exit_code == 0, result.output
    assert f"removed uncommitted {new_dead}" in result.output
    assert [(i.step, i.committed) for i in list_checkpoints(ckpt.root)] == [(3, True)]


def test_gc_refuses_keep_zero(tmp_path: Path) -> None:
    result = _cli("checkpoints", "gc", f"file://{tmp_path}", "--keep", "0")
    assert result.exit_code == 2
    assert "--keep" in result.output


def test_missing_bucket_is_reported_without_credentials(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    for command in ("list", "verify", "gc"):
        result = _cli("checkpoints", command, "s3://no-such-bucket-here/run")
        assert result.exit_code == 1, result.output
        assert "s3://no-such-bucket-here/run is not reachable" in result.output
        assert "no-such-bucket-here does not exist" in result.output
        assert f"={SECRET}" not in result.output and f": {SECRET}" not in result.output


def test_credentials_in_a_url_are_never_printed(tmp_path: Path) -> None:
    result = _cli("checkpoints", "list", "s3://someone:hunter2@no-such-bucket-here/run")
    assert result.exit_code == 1
    assert "hunter2" not in result.output


def test_verify_of_an_empty_root_says_nothing_is_committed(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    result = _cli("checkpoints", "verify", str(tmp_path / "ckpt"))
    assert result.exit_code == 1
    assert "no committed checkpoint under" in result.output


# --------------------------------------------------------------------------- resume


def _spec(name: str, url: str, args: list[str] | None = None) -> Any:
    return load_job_data(
        {
            "name": name,
            "entrypoint": {"script": "examples/train_tiny.py", "args": args or []},
            "nodes": {"min": 1, "max": 3},
            "checkpoint": {"url": url},
        }
    )


def _submit_finished(client: Any, spec: Any, phase: JobPhase) -> None:
    jobs.submit(client, spec)
    status = records.JobStatus(spec.name, phase=phase)
    records.write(client, keys.job_status(spec.name), status)


def _etcd_args(etcd: Any) -> list[str]:
    return ["--etcd", etcd.endpoint]


def test_resume_resubmits_from_the_newest_committed_checkpoint(
    etcd: Any, etcd_client: Any, backend: tuple[str, dict[str, Any]]
) -> None:
    url, options = backend
    name = f"res-{uuid.uuid4().hex[:6]}"
    spec = _spec(name, url)
    ckpt = _save(url, options, [10, 20], job_spec_hash=jobs.checkpoint_hash(spec))
    _dead(ckpt.root, 30)
    _submit_finished(etcd_client, spec, JobPhase.FAILED)

    result = _cli("resume", name, *_etcd_args(etcd))
    assert result.exit_code == 0, result.output
    newest = ckpt.latest()
    assert newest is not None
    assert f"job '{name}' resumes from step 20" in result.output
    assert "resharded from 1 to up to 3 ranks" in result.output
    request = jobs.read_resume(etcd_client, name)
    # the root's newest was picked (not named): one that fails verification gives way
    assert request == jobs.ResumeRequest(url=newest.url, step=20, world_size=1, newest=True)
    status = jobs.read_status(etcd_client, name)
    assert status is not None and status.phase is JobPhase.PENDING  # submitted again


def test_resume_from_a_given_checkpoint_directory(
    etcd: Any, etcd_client: Any, tmp_path: Path
) -> None:
    name = f"res-{uuid.uuid4().hex[:6]}"
    spec = _spec(name, f"file://{tmp_path}/own")
    other = _save(f"file://{tmp_path}/other", {}, [7, 8], job_spec_hash=jobs.checkpoint_hash(spec))
    older = next(i for i in other.list() if i.step == 7)
    _submit_finished(etcd_client, spec, JobPhase.STOPPED)

    result = _cli("resume", name, "--from", older.url, *_etcd_args(etcd))
    assert result.exit_code == 0, result.output
    assert jobs.read_resume(etcd_client, name) == jobs.ResumeRequest(older.url, 7, 1)


def test_resume_refuses_a_checkpoint_of_another_setup_unless_forced(
    etcd: Any, etcd_client: Any, tmp_path: Path
) -> None:
    name = f"res-{uuid.uuid4().hex[:6]}"
    url = f"file://{tmp_path}/ckpt"
    saved_by = _spec(name, url, args=["--hidden", "64"])
    _save(url, {}, [4], job_spec_hash=jobs.checkpoint_hash(saved_by))
    # Only node counts and the checkpoint URL differing would not matter:
    assert jobs.checkpoint_hash(_spec("x", "file:///elsewhere", ["--hidden", "64"])) == (
        jobs.checkpoint_hash(saved_by)
    )
    spec = _spec(name, url, args=["--hidden", "128"])
    _submit_finished(etcd_client, spec, JobPhase.FAILED)

    result = _cli("resume", name, *_etcd_args(etcd))
    assert result.exit_code == 1
    assert "different entrypoint, arguments or gradient compression" in result.output
    assert "Pass --force" in result.output
    assert jobs.read_resume(etcd_client, name) is None  # nothing was resubmitted

    result = _cli("resume", name, "--force", *_etcd_args(etcd))
    assert result.exit_code == 0, result.output
    request = jobs.read_resume(etcd_client, name)
    assert request is not None and request.step == 4


def test_resume_refuses_an_active_job_and_a_missing_checkpoint(
    etcd: Any, etcd_client: Any, tmp_path: Path
) -> None:
    name = f"res-{uuid.uuid4().hex[:6]}"
    url = f"file://{tmp_path}/ckpt"
    spec = _spec(name, url)
    _submit_finished(etcd_client, spec, JobPhase.RUNNING)
    result = _cli("resume", name, *_etcd_args(etcd))
    assert result.exit_code == 1
    assert f"job '{name}' is Running" in result.output and "ringmaster stop" in result.output

    records.write(etcd_client, keys.job_status(name), records.JobStatus(name, JobPhase.FAILED))
    (tmp_path / "ckpt").mkdir()
    result = _cli("resume", name, *_etcd_args(etcd))
    assert result.exit_code == 1
    assert "no committed checkpoint under" in result.output

    result = _cli("resume", "no-such-job", *_etcd_args(etcd))
    assert result.exit_code == 1 and "no job named 'no-such-job'" in result.output


def test_resume_reports_an_unreachable_bucket_before_submitting(
    etcd: Any, etcd_client: Any, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    name = f"res-{uuid.uuid4().hex[:6]}"
    spec = _spec(name, "s3://no-such-bucket-here/run")
    _submit_finished(etcd_client, spec, JobPhase.FAILED)
    result = _cli("resume", name, *_etcd_args(etcd))
    assert result.exit_code == 1
    assert "no-such-bucket-here does not exist" in result.output
    status = jobs.read_status(etcd_client, name)
    assert status is not None and status.phase is JobPhase.FAILED  # untouched


def test_gc_refuses_a_checkpoint_directory_and_a_newer_sweep_under_a_live_writer(
    tmp_path: Path,
) -> None:
    """Bad input loses nothing: a checkpoint directory given to gc (retention would
    apply to the root around it, that directory included), and --include-newer while a
    live run writes the root (one of the newer directories is its save in progress)."""
    url = f"file://{tmp_path}"
    ckpt = _save(url, {}, [1, 2, 3])
    dead = _dead(ckpt.root, 9)
    before = [(i.step, i.committed) for i in list_checkpoints(ckpt.root)]
    one = next(i for i in list_checkpoints(ckpt.root) if i.step == 1)
    result = _cli("checkpoints", "gc", f"{url}/{one.name}", "--keep", "1")
    assert result.exit_code == 1, result.output
    assert "is a checkpoint directory; gc applies retention to a checkpoint root" in result.output
    assert [(i.step, i.committed) for i in list_checkpoints(ckpt.root)] == before

    now = time.time()
    live = WriterMarker("other@1", "t0", "writer", 2, "box-a", 7, "127.0.0.1:2379", now, now)
    assert MarkerStore(url).create(live)
    result = _cli("checkpoints", "gc", url, "--keep", "1", "--include-newer")
    assert result.exit_code == 1, result.output
    assert "is being written by a live run (other@1, run 2 of job 'writer')" in result.output
    assert [(i.step, i.committed) for i in list_checkpoints(ckpt.root)] == before
    result = _cli("checkpoints", "gc", url, "--keep", "1")  # the newer one stays
    assert result.exit_code == 0, result.output
    assert [i.name for i in list_checkpoints(ckpt.root) if not i.committed] == [dead]


def test_verify_of_a_directory_of_another_step_or_none_says_so(tmp_path: Path) -> None:
    """`list` calls a checkpoint copied to another step's name uncommitted: `verify`
    of it fails too (it said OK and marked it verified), and a directory that does not
    exist is named as such."""
    url = f"file://{tmp_path}"
    ckpt = _save(url, {}, [2])
    (info,) = list_checkpoints(ckpt.root)
    copied = step_dir_name(7, "faac91ef")
    ckpt.root.fs.copy(ckpt.root.path(info.name), ckpt.root.path(copied), recursive=True)
    result = _cli("checkpoints", "verify", f"{url}/{copied}")
    assert result.exit_code == 1, result.output
    assert "is named step 7 but its manifest is of step 2" in result.output, result.output
    missing = step_dir_name(9, "dddddddd")
    result = _cli("checkpoints", "verify", f"{url}/{missing}")
    assert result.exit_code == 1 and f"{missing} does not exist" in result.output, result.output


def test_list_shows_a_directory_it_cannot_read_and_every_other_one(tmp_path: Path) -> None:
    """One checkpoint directory that cannot be read (here its manifest is a directory:
    reading it fails as a permission error would, which root does not meet) is listed
    with the error; the others are listed as before.  A restore still refuses to guess."""
    url = f"file://{tmp_path}"
    ckpt = _save(url, {}, [2, 4])
    broken = step_dir_name(6, "0badc0de")
    (tmp_path / broken / "manifest.json").mkdir(parents=True)
    result = _cli("checkpoints", "list", url)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if broken in line)
    assert "not committed: cannot be read (IsADirectoryError" in row, result.output
    assert sum("not verified" in line for line in result.output.splitlines()) == 2
    with pytest.raises(Exception, match=f"cannot read .*{broken}"):
        list_checkpoints(ckpt.root)


def test_list_gc_and_verify_of_a_file_say_it_is_not_a_root(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not checkpoints\n")
    for command in (["list"], ["gc", "--keep", "1"], ["verify"]):
        result = _cli("checkpoints", *command, f"file://{tmp_path}/notes.txt")
        assert result.exit_code != 0, (command, result.output)
        assert "is a file, not a checkpoint root" in result.output, (command, result.output)
