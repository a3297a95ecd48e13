"""Hostile input on the command line gets one line naming it and what is valid.

Through the real CLI (click's runner): a job file that is not UTF-8, an
``--etcd-timeout`` that is no usable number of seconds, and checkpoint URLs
with a protocol that cannot hold checkpoints.  None of them reaches etcd or
the network, and none ends in a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from checkpoint.api import CHECKPOINT_PROTOCOLS
from orchestrator.cli import main
from orchestrator.spec.checkpoint import CHECKPOINT_SCHEMES

pytestmark = pytest.mark.unit


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "250"})


def _no_traceback(result: Result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output


@pytest.fixture
def latin1_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    job = tmp_path / "job.yaml"
    job.write_bytes("name: demo\n# café\nentrypoint: train.py\n".encode("latin-1"))
    return job


@pytest.mark.parametrize(
    "command", [["validate"], ["run"], ["submit", "--etcd", "127.0.0.1:9"]], ids=lambda c: c[0]
)
def test_a_job_file_that_is_not_utf8_is_named_with_where_and_what_to_do(
    latin1_job: Path, command: list[str]
) -> None:
    result = _cli(*command, str(latin1_job))
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.output.splitlines() if "UTF-8" in ln]
    assert f"{latin1_job}:2:" in line
    assert "byte 0xe9 at offset 16 (line 2, column 6)" in line
    assert "save the file as UTF-8" in line


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "1e999", "soon"])
def test_etcd_timeout_must_be_a_finite_positive_number_of_seconds(value: str) -> None:
    result = _cli("status", "--etcd", "127.0.0.1:9", f"--etcd-timeout={value}")
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.output.splitlines() if "--etcd-timeout" in ln]
    assert f"'{value}' is not a number of seconds above 0" in line


@pytest.mark.parametrize(
    "args",
    [
        ["checkpoints", "list", "ftp://x/y"],
        ["checkpoints", "gc", "ftp://x/y"],
        ["checkpoints", "verify", "ftp://x/y"],
        ["checkpoints", "list", "zip://x"],
    ],
    ids=lambda a: f"{a[1]}-{a[2].split(':')[0]}",
)
def test_a_checkpoint_url_of_another_protocol_is_named_with_those_that_work(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # zip:// would open the current directory as an archive
    result = _cli(*args)
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    (line,) = result.output.splitlines()
    url = args[2]
    assert line.startswith(f"error: {url}: protocol '{url.split(':')[0]}' cannot hold")
    assert "s3://" in line and "file://" in line and "a local path" in line


def test_run_from_a_url_of_another_protocol_fails_before_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: demo\nentrypoint: train.py\ncheckpoint: {{url: {tmp_path}/c}}\n")
    result = _cli("run", str(job), "--from", "ftp://x/y")
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    (line,) = result.output.splitlines()
    assert "ftp://x/y: protocol 'ftp' cannot hold checkpoints" in line


def test_the_spec_and_the_checkpoint_package_accept_the_same_protocols() -> None:
    assert set(CHECKPOINT_SCHEMES) == set(CHECKPOINT_PROTOCOLS)


@pytest.mark.parametrize("name", ["../../etc", "Bad_Name!"])
def test_a_job_name_that_cannot_be_a_key_is_one_line(name: str) -> None:
    """``logs`` without --etcd reads this machine's files: the name is checked first."""
    result = _cli("logs", name)
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: job name '{name}' cannot be used")


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--etcd", "localhost"], {}, "--etcd: etcd endpoint 'localhost' is not host:port"),
        (["--etcd", "127.0.0.1:x"], {}, "--etcd: etcd endpoint '127.0.0.1:x' is not host:port"),
        (["--etcd", ","], {}, "--etcd gives no etcd endpoint"),
        ([], {"RINGMASTER_ETCD": "a:1,bad"}, "RINGMASTER_ETCD: etcd endpoint 'bad' is not"),
    ],
    ids=["no-port", "port-not-a-number", "empty", "env"],
)
def test_a_malformed_etcd_endpoint_is_a_usage_error_naming_where_it_came_from(
    args: list[str], env: dict[str, str], named: str
) -> None:
    result = CliRunner().invoke(main, ["status", "demo", *args], env={"COLUMNS": "250", **env})
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {named}"), result.output
