"""The restart tier: an unmodified torchrun script under ringmaster, with real processes.

``examples/train_torchrun.py`` (DistributedSampler, DataLoader, DDP, its own
``torch.save`` checkpoints) runs under stock ``torchrun --standalone`` and,
unchanged, under ``ringmaster run`` with 2 nodes and a warm spare.  One node
is SIGKILLed (agent and worker) mid-run: the spare takes its slot, every
worker starts again from a pre-imported standby with torchrun's environment,
the script resumes from its newest checkpoint, and the final parameters equal
the fault-free torchrun run's (same world size, same data order).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from orchestrator.local_run import LocalRun
from orchestrator.spec.entrypoint import resolve_recovery
from orchestrator.spec.job import JobSpec, RecoveryMode
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs
from tests.chaos.jobs import REPO, quiet_run, summary

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = REPO / "examples" / "train_torchrun.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
#: 1024 samples, 2 ranks, 16 per rank: 32 steps an epoch
EPOCHS, STEPS = 2, 64


def _args(tmp: Path, out: Path) -> list[str]:
    return [
        "--epochs",
        str(EPOCHS),
        "--step-time",
        "0.04",
        "--checkpoint-every",
        "8",
        "--out",
        str(out),
        "--step-log",
        str(tmp / "steps"),
    ]


def _job(
    name: str, tmp: Path, script: Path = SCRIPT, args: list[str] | None = None, **ft: object
) -> JobSpec:
    (tmp / "steps").mkdir(exist_ok=True)
    spec = load_job_data(
        {
            "name": name,
            "entrypoint": {"script": str(script), "args": args or _args(tmp, tmp / "final.pt")},
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "checkpoint": {"url": f"file://{tmp}/ckpt"},
            "fault_tolerance": {"max_restarts": 2, **ft},
        }
    )
    resolved, _ = resolve_recovery(spec, REPO)
    return resolved


def _steps(tmp: Path) -> dict[str, list[tuple[int, float, int]]]:
    """Each rank's ``(step, time, restart count)`` lines."""
    out = {}
    for f in sorted((tmp / "steps").glob("*.log")):
        rows = [line.split() for line in f.read_text().splitlines()]
        out[f.stem] = [(int(s), float(t), int(r)) for s, t, r, _pid in rows]
    return out


@pytest.fixture(scope="module")
def torchrun_params(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same script under stock torchrun, no failure: the reference parameters."""
    tmp = tmp_path_factory.mktemp("torchrun")
    (tmp / "steps").mkdir()
    args = [*_args(tmp, tmp / "final.pt"), "--checkpoint-dir", str(tmp / "ckpt")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node=2", str(SCRIPT), *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"finished at step {STEPS}" in done.stdout, done.stdout[-2000:]
    # it saved its own checkpoints in the fallback directory
    assert sorted(p.name for p in (tmp / "ckpt").glob("ckpt-*.pt"))[-1] == f"ckpt-{STEPS:08d}.pt"
    return torch.load(tmp / "final.pt")  # type: ignore[no-any-return]


def test_stock_torchrun_runs_the_script(torchrun_params: dict[str, torch.Tensor]) -> None:
    assert set(torchrun_params) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def _kill_when(run: LocalRun, tmp: Path, step: int, killed: list[tuple[str, float]]) -> None:
    """SIGKILL the node of rank 0 once rank 0 logged ``step`` (a checkpoint lies behind it)."""
    log = tmp / "steps" / "rank-0.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if lines and int(lines[-1].split()[0]) >= step:
            status = jobs.read_status(run.client, run.spec.name)
            if status is not None and status.active_nodes:
                node = status.active_nodes[0]
                killed.append((node, time.time()))
                run.kill_node(node)
                return
        time.sleep(0.02)


def test_sigkill_node_spare_restarts_script_from_its_checkpoint(
    tmp_path: Path, torchrun_params: dict[str, torch.Tensor]
) -> None:
    spec = _job("restart-tier", tmp_path)
    assert spec.fault_tolerance.recovery is RecoveryMode.RESTART
    lines: list[str] = []
    killed: list[tuple[str, float]] = []
    with quiet_run(spec, lines, timeout=timedelta(seconds=150)) as run:
        killer = threading.Thread(target=_kill_when, args=(run, tmp_path, 20, killed))
        killer.start()
        result = run.wait()
        killer.join()
    assert killed, summary(result, lines)
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries == 1, summary(result, lines)
    kinds = [e.type for e in result.events]
    assert "NodeFailed" in kinds and "Recovered" in kinds, kinds
    generations = [e for e in result.events if e.type == "Generation"]
    assert len(generations) == 2 and "replaces" in generations[1].message, generations
    # no script error was counted: the peer's broken collective was the node's death
    assert "Restart" not in kinds, kinds
    # what a person reads: the failed node first, the survivor's traceback folded after it
    victim = killed[0][0]
    failed_at = next(i for i, x in enumerate(lines) if x.startswith("[event] NodeFailed:"))
    assert f"[event] NodeFailed: {victim}: agent of {victim} gone" in lines[failed_at], lines
    before = "\n".join(lines[:failed_at])
    assert "Traceback" not in before and "[event] WorkerExited" not in before, before[-3000:]
    assert "[event] Phase: Recovering" not in before, before[-3000:]
    folded = [x for x in lines if f"after {victim} failed (a consequence, not the cause)" in x]
    # the survivor's worker died on the collective its peer left (its traceback is folded
    # after the failure; gloo words the lost peer as a reset or a close, depending on which
    # side saw it first), or its agent stopped it for the new generation before it got
    # there (the controller's watch saw the death first): nothing to fold
    assert len(folded) <= 1, folded
    lost_peer = ("Connection reset by peer", "Connection closed by peer")
    assert all("RuntimeError" in x and any(t in x for t in lost_peer) for x in folded), folded
    (recovering,) = [e.message for e in result.events if e.message.startswith("Recovering")]
    assert f"replaces {victim}" in recovering and "RuntimeError" not in recovering, recovering
    (recovered,) = [e.message for e in result.events if e.type == "Recovered"]
    # the survivor's script prints a line when it resumes: the recovery ends there
    assert "made progress again (its first line of output)" in recovered, recovered
    assert "first step" not in recovered, recovered
    # rank 0 stayed on the survivor (a spare may have no checkpoint to broadcast)
    first, second = (
        [n.strip() for n in g.message.split(": ", 1)[1].split(" (")[0].split(",")]
        for g in generations
    )
    assert second[0] in first and second[0] != victim, generations
    steps = _steps(tmp_path)
    rank0 = steps["rank-0"]
    before = [s for s, _, r in rank0 if r == 0]
    after = [s for s, _, r in rank0 if r == 1]
    assert before and after, rank0
    # resumed from the newest checkpoint (every 8 steps) before the kill, not from 0
    assert after[0] == 8 * ((after[0] - 1) // 8) + 1 and after[0] > 1, (before, after)
    assert after[0] <= before[-1] + 1 and after[-1] == STEPS, (before, after)
    final = torch.load(tmp_path / "final.pt")
    for k, v in torchrun_params.items():
        assert torch.equal(final[k], v), f"{k} differs from the fault-free torchrun run"


def test_script_error_restarts_then_fails_with_its_message(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text(
        "import os\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('boom in restart ' + os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "dist.barrier()\n"
    )
    spec = _job("restart-error", tmp_path, script=script, args=[], max_restarts=1)
    lines: list[str] = []
    with quiet_run(spec, lines, timeout=timedelta(seconds=90)) as run:
        result = run.wait()
    assert result.phase is JobPhase.FAILED, summary(result, lines)
    restarts = [e for e in result.events if e.type == "Restart"]
    assert len(restarts) == 1, [e.message for e in result.events]
    failed = [e for e in result.events if e.type == "Phase" and e.message.startswith("Failed")]
    # the culprit is named (rank 1's error, as torch prefixes it), not rank 0's broken barrier
    message = failed[-1].message if failed else ""
    assert "failed in generation 2: exit code 1: [rank1]: ValueError: boom in restart 1" in (
        message
    ), failed
    assert "NodeFailed" not in [e.type for e in result.events]
    assert result.recoveries == 0
