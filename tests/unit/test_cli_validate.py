"""`ringmaster validate` prints OK or every problem and exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from orchestrator.cli import main

pytestmark = pytest.mark.unit


def test_validate_ok(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: demo\nentrypoint: train.py\n")
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["validate", str(f)])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output and "demo" in result.output


def test_validate_names_a_missing_script_and_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: demo\nentrypoint: trian.py\n")
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["validate", str(f)])
    assert result.exit_code == 2
    assert "entrypoint.script: script 'trian.py' was not found" in result.output
    assert f"looked for {tmp_path.resolve() / 'trian.py'}" in result.output


def test_validate_names_a_module_that_cannot_be_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: demo\nentrypoint: {module: no_such_pkg_x.train}\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["validate", str(f)])
    assert result.exit_code == 2
    assert "module 'no_such_pkg_x.train' cannot be imported" in result.output


def test_validate_lists_problems_and_exits_2(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: demo\nentrypoint: train.py\nnodes: {min: 4, max: 2}\nnproc: 1\n")
    result = CliRunner().invoke(main, ["validate", str(f)])
    assert result.exit_code == 2
    assert f"{f}:3: nodes.min: nodes.min (4) is larger than nodes.max (2)" in result.output
    assert f"{f}:4: nproc: unknown key 'nproc'; did you mean 'nproc_per_node'?" in result.output


def test_validate_missing_file_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "cannot read" in result.output


def test_every_example_job_validates() -> None:
    examples = sorted(Path(__file__).resolve().parents[2].glob("examples/*.yaml"))
    assert examples, "examples/ has no job files"
    for f in examples:
        result = CliRunner().invoke(main, ["validate", str(f)])
        assert result.exit_code == 0, f"{f}: {result.output}"


def test_validate_prints_the_resolved_recovery_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: demo\nentrypoint: train.py\n")
    (tmp_path / "train.py").write_text("import torch.distributed as dist\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["validate", str(f)], terminal_width=80)
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("recovery:")]
    assert line == (
        "recovery: restart (train.py never calls runtime.init(); a peer's failure restarts "
        "all workers from the script's own checkpoint)"
    )


def test_validate_in_process_for_a_plain_script_is_one_line_with_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: demo\nentrypoint: train.py\nfault_tolerance:\n  recovery: in_process\n")
    (tmp_path / "train.py").write_text("import torch.distributed as dist\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["validate", str(f)])
    assert result.exit_code == 2
    (line,) = [x for x in result.output.splitlines() if "fault_tolerance.recovery" in x]
    assert line.strip().startswith(f"{f}:4: fault_tolerance.recovery: is 'in_process' but train.py")
    assert "never calls runtime.init()" in line


def _validate_plain(tmp_path: Path, job: str) -> tuple[Path, Result]:
    """``ringmaster validate`` of ``job`` beside a script that never calls runtime.init()
    (the caller has changed to ``tmp_path``)."""
    f = tmp_path / "job.yaml"
    f.write_text(job)
    (tmp_path / "train.py").write_text("import torch.distributed as dist\n")
    return f, CliRunner().invoke(main, ["validate", str(f)])


def test_settings_only_the_runtime_acts_on_are_refused_to_a_plain_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` resolved to the restart tier: each such setting is named with its line."""
    monkeypatch.chdir(tmp_path)
    f, result = _validate_plain(
        tmp_path,
        "name: demo\nentrypoint: train.py\nmax_steps: 100\ncheckpoint:\n  every_steps: 10\n"
        "fault_tolerance:\n  preemption_grace: 60s\n  stragglers:\n    action: swap\n",
    )
    assert result.exit_code == 2, result.output
    named = [x.strip() for x in result.output.splitlines() if "here 'restart'" in x]
    assert [line.split(": ", 2)[:2] for line in named] == [
        [f"{f}:3", "max_steps"],
        [f"{f}:5", "checkpoint.every_steps"],
        [f"{f}:8", "fault_tolerance.stragglers"],
    ], result.output
    assert "(the script counts its own steps)" in named[0], named[0]
    assert "train.py never calls runtime.init()" in named[0], named[0]


def test_a_restart_tier_job_file_with_only_what_it_uses_validates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    job = (
        "name: demo\nentrypoint: train.py\nnodes: {min: 2, max: 2, spares: 1}\n"
        "checkpoint:\n  url: file:///tmp/ckpt\ncomm:\n  backend: gloo\n"
        "fault_tolerance:\n  recovery: restart\n  max_restarts: 5\n  preemption_grace: 60s\n"
    )
    _, result = _validate_plain(tmp_path, job)
    assert result.exit_code == 0, result.output
    _, result = _validate_plain(tmp_path, job + "  hang_timeout: 60s\n")
    assert result.exit_code == 2, result.output
    assert "fault_tolerance.hang_timeout: only the ringmaster runtime acts on it" in result.output
