"""One script, three launchers: a runtime script under stock torchrun, the
restart tier's refusal, and another distribution's package shadowing ours.

Real processes throughout: stock ``torchrun --standalone`` with two gloo
workers, and fresh interpreters whose ``sys.path`` holds a foreign package.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agents.api import RECOVERY_RESTART, RecoveryError, WorkerEnv
from agents.runtime.process_group import publish_environment
from orchestrator.state.records import Member, Plan

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
SCRIPT = REPO / "examples" / "train_tiny.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _run(argv: list[str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a session of its own; on a timeout kill all of it (torchrun's
    workers too) and fail with what it printed."""
    proc = subprocess.Popen(
        argv,
        env=_env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(argv[:3])} still ran after {timeout:g}s; output:\n{out[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def test_runtime_script_trains_under_stock_torchrun(tmp_path: Path) -> None:
    """The same file `ringmaster run` hot-swaps trains under `torchrun --standalone`,
    with DDP over two ranks, to the parameters of a single-rank run."""
    two = _run(
        [
            str(TORCHRUN),
            "--standalone",
            "--nproc-per-node=2",
            str(SCRIPT),
            "--steps",
            "30",
            "--out",
            str(tmp_path / "two.pt"),
        ],
        tmp_path,
    )
    assert two.returncode == 0, two.stdout[-3000:]
    said = two.stdout + two.stderr
    # each rank says once that there is no hot-swap here
    assert said.count("without hot-swap") == 2, said[-3000:]
    assert "finished at step 30" in said
    one = _run(
        [sys.executable, str(SCRIPT), "--steps", "30", "--out", str(tmp_path / "one.pt")], tmp_path
    )
    assert one.returncode == 0, one.stdout[-3000:]
    a = torch.load(tmp_path / "two.pt")
    b = torch.load(tmp_path / "one.pt")
    assert a.keys() == b.keys()
    for k in a:  # one global batch per step either way: the same training, up to rounding
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), rtol=1e-5, atol=1e-5)


def test_the_flagship_lm_and_a_sharded_script_outside_an_agent(tmp_path: Path) -> None:
    """Plain ``python``: the LM example (which reads ``session.spec`` and
    ``session.outer_steps``) trains and ends; an FSDP2 script is refused in one line
    that says what it needs."""
    lm = _run(
        [
            sys.executable,
            str(REPO / "examples" / "train_lm.py"),
            "--short",
            "--steps",
            "2",
            "--log-every",
            "1",
        ],
        tmp_path,
    )
    assert lm.returncode == 0, lm.stdout[-3000:]
    assert "step 1 loss" in lm.stdout and "finished at step 2" in lm.stdout, lm.stdout[-3000:]
    fsdp = _run(
        [
            sys.executable,
            str(REPO / "examples" / "train_sharded.py"),
            "--sharding",
            "fsdp",
            "--steps",
            "2",
        ],
        tmp_path,
    )
    assert fsdp.returncode != 0, fsdp.stdout[-3000:]
    assert "ValueError: wrap(sharding='fsdp') needs a ringmaster agent" in fsdp.stdout, fsdp.stdout[
        -3000:
    ]


def test_runtime_refuses_the_restart_tier_in_one_line() -> None:
    from agents import runtime

    env = WorkerEnv(
        job="j",
        node="n0",
        local_rank=0,
        local_world_size=1,
        etcd_endpoints="127.0.0.1:1",
        recovery=RECOVERY_RESTART,
    )
    with pytest.raises(RecoveryError) as e:
        runtime.init(env)
    message = str(e.value)
    assert "\n" not in message
    assert "recovery: restart" in message and "recovery: in_process" in message


def test_torchrun_variables_follow_the_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a hot-swap, RANK, WORLD_SIZE and MASTER_* name the new generation."""
    for name in (
        "RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.setenv(name, "stale")
    plan = Plan(
        generation=3,
        members=[
            Member(node="a", rank_base=0, nproc=2),
            Member(node="spare", rank_base=2, nproc=2),
        ],
    )
    publish_environment(plan, "spare", 3, "10.0.0.7", 29411)
    assert os.environ["RANK"] == "3"
    assert os.environ["WORLD_SIZE"] == "4"
    assert os.environ["GROUP_RANK"] == "1"
    assert os.environ["GROUP_WORLD_SIZE"] == "2"
    assert os.environ["LOCAL_WORLD_SIZE"] == "2"
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.7", "29411")


@pytest.mark.parametrize("name", ["agents", "checkpoint"])
def test_a_shadowing_package_is_named_in_one_line(tmp_path: Path, name: str) -> None:
    """Another distribution's top-level package of the same name (openai-agents
    installs ``agents``) is found before anything fails far from the cause."""
    foreign = tmp_path / "site" / name
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text("")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
    cli = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "--help"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2
    lines = cli.stderr.strip().splitlines()
    assert len(lines) == 1, cli.stderr
    assert str(foreign / "__init__.py") in lines[0]
    assert str(REPO / name) in lines[0]
