"""Hot-swap with real processes and real signals: nothing completed is lost.

Each run starts a private etcd, a controller and three node agents (two active,
one warm spare) as separate processes on 127.0.0.1; each agent runs its
workers.  Failures are real signals to real processes.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from orchestrator.api import JobPhase
from orchestrator.cli import main
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs, keys
from tests.chaos.jobs import assert_exactly_once, quiet_run, step_log, summary, tiny_job
from tests.chaos.tiny_by_hand import tiny_final
from tests.faults.partitioned_job import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 120


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """Final parameters of a fault-free run of the same job (computed here)."""
    return tiny_final(STEPS)


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7), f"{k} differs"


def test_sigkill_whole_node_spare_takes_over_nothing_lost(
    tmp_path: Path, reference: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines: list[str] = []
    monkeypatch.setenv("RINGMASTER_LOG_DIR", str(tmp_path / "logs"))  # the agents' files
    spec = tiny_job("kill-node", tmp_path, steps=STEPS)
    with quiet_run(spec, lines, kill_node_at_step=40) as run:
        result = run.wait()
        assert result.killed_node is not None
        endpoint = run.etcd_options.endpoints[0]
        logs = CliRunner().invoke(
            main, ["logs", spec.name, "--node", result.killed_node, "--etcd", endpoint]
        )
        live = CliRunner().invoke(main, ["logs", spec.name, "--tail", "5", "--etcd", endpoint])
        # the survivor's workers reported the break through their agent: one record
        relayed = run._client.get_prefix(keys.job_node_reports(spec.name, 1))
        own = run._client.get_prefix(keys.job_reports(spec.name, 1))
    reporting = [kv.key.rsplit("/", 1)[1] for kv in relayed]
    assert len(reporting) == 1 and reporting != [result.killed_node], summary(result, lines)
    assert own == [], own
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries == 1, summary(result, lines)
    # the dead node's output stays on its host (rank 0 printed step 0); a SIGKILLed agent
    # stored no tail in etcd, so `logs` has nothing of it, and says no more than that
    kept = tmp_path / "logs" / spec.name / result.killed_node / "0"
    assert "step 0 loss" in "".join(f.read_text() for f in kept.glob("*.log"))
    assert logs.exit_code == 0, logs.output
    # the workers that exited at the end left their last lines in etcd (the survivor
    # printed that its generation ended); the killed node's workers left none
    shown = [line for line in live.output.splitlines() if line.startswith("[")]
    assert live.exit_code == 0 and 0 < len(shown) <= 5, live.output
    assert any("generation 1 ends" in line for line in shown), live.output
    assert not any(line.startswith(f"[{result.killed_node}/") for line in shown), live.output
    kinds = [e.type for e in result.events]
    assert "NodeFailed" in kinds
    # declared dead first-hand, without waiting out a grace: the controller's watch of
    # the agent closed with its process, or (had a survivor's report come first) the
    # agent's liveness port refused the probe
    failed = next(e for e in result.events if e.type == "NodeFailed")
    assert re.search(
        r"gone \((its liveness watch closed|liveness port refused)\) \(agent_gone\)",
        failed.message,
    ), failed.message
    generations = [e for e in result.events if e.type == "Generation"]
    assert len(generations) == 2 and "replaces" in generations[1].message
    assert_exactly_once(tmp_path, STEPS)
    # the spare's worker trained: it has a step log starting after the kill
    spare_logs = [s for w, s in step_log(tmp_path).items() if not w.startswith(result.killed_node)]
    assert any(seq and seq[0] >= 40 for seq in spare_logs)
    assert_same_params(torch.load(tmp_path / "final.pt"), reference)


def test_two_survivors_each_send_the_spare_a_share_and_nothing_is_lost(tmp_path: Path) -> None:
    """Two nodes of two workers and a spare of two: a SIGKILLed node leaves two ranks at
    the newest step, which hold the DDP model and optimizer alike; each sends the spare's
    workers a share of them (the rest, such as the RNG state, from the first), and the
    run ends with the parameters of a fault-free run of four ranks."""
    lines: list[str] = []
    go = tmp_path / "go"
    hold = ["--hold-at", "30", "--go-file", str(go)]
    base = tiny_job("two-senders", tmp_path, steps=60, extra_args=hold).to_dict()
    base["nproc_per_node"] = 2
    spec = load_job_data(base)
    with quiet_run(spec, lines) as run:
        # every worker holds before step 30, so the survivors stand at one step (a kill
        # mid step may leave them a step apart: then one is behind and receives too)
        wait_for("every worker at step 30", lambda: _all_applied(tmp_path, 4, 29))
        status = jobs.read_status(run.client, spec.name)
        assert status is not None
        run.kill_node(status.active_nodes[0])
        go.touch()
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries == 1, summary(result, lines)
    shares = [line for line in lines if "the tensors the ranks hold alike are sent in" in line]
    assert shares, summary(result, lines)
    sent = re.findall(r"rank \d+ ([\d,]+) bytes", shares[0])
    assert len(sent) == 2 and all(int(n.replace(",", "")) > 0 for n in sent), shares[0]
    assert_exactly_once(tmp_path, 60)
    assert_same_params(torch.load(tmp_path / "final.pt"), tiny_final(60, world=4))


def _all_applied(tmp: Path, workers: int, step: int) -> bool:
    try:
        logs = step_log(tmp)
    except (ValueError, IndexError):  # a line being written
        return False
    return len(logs) == workers and all(step in seq for seq in logs.values())


@pytest.mark.long  # short form: the soak's worker-hang (chaos/test_soak.py)
def test_sigstop_worker_hang_is_detected_and_recovered(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    lines: list[str] = []
    spec = tiny_job("hang", tmp_path, steps=STEPS, hang_timeout="3s")
    with quiet_run(spec, lines) as run:
        victim_pid = _wait_for_worker_at_step(run, 30)
        stopped_at = time.monotonic()
        os.kill(victim_pid, signal.SIGSTOP)
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    hung = [e for e in result.events if e.type == "WorkerHung"]
    assert hung, summary(result, lines)
    detected_after = hung[0].time - (time.time() - (time.monotonic() - stopped_at))
    assert detected_after < 3 + 3 * 0.5 + 2, f"hang detected after {detected_after:.1f}s"
    assert result.recoveries >= 1
    assert_exactly_once(tmp_path, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), reference)


@pytest.mark.long  # short form: the soak's controller-kill (chaos/test_soak.py)
def test_sigkill_leader_controller_standby_takes_over(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    lines: list[str] = []
    spec = tiny_job("leader", tmp_path, steps=STEPS, step_time=0.06)
    with quiet_run(spec, lines, controllers=2, kill_node_at_step=90) as run:
        _wait_for_worker_at_step(run, 20)
        leader = next(
            p
            for name, p in run.procs.items()
            if name.startswith("controller")
            and any(f"[{name}]" in line and "is now the leader" in line for line in lines)
        )
        leader.popen.send_signal(signal.SIGKILL)
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    leaders = [line for line in lines if "is now the leader" in line]
    assert len(leaders) == 2, leaders
    # the new leader handled the node failure that came after the old one died
    assert result.recoveries == 1
    assert_exactly_once(tmp_path, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), reference)


def _wait_for_worker_at_step(run, step: int, timeout: float = 90) -> int:  # type: ignore[no-untyped-def]
    """Wait until the job reaches ``step``; return the pid of an active worker."""
    from orchestrator.controller.world import read_progress
    from orchestrator.state import jobs, keys

    deadline = time.monotonic() + timeout
    client = run._client
    while time.monotonic() < deadline:
        status = jobs.read_status(client, run.spec.name)
        if status and status.step >= step and status.active_nodes:
            progress = read_progress(client, run.spec.name).get(
                keys.worker_id(status.active_nodes[-1], 0)
            )
            if progress:
                return progress.pid
        time.sleep(0.1)
    raise AssertionError(f"job did not reach step {step} in {timeout}s")


@pytest.mark.long  # short form: the soak's preemption (chaos/test_soak.py)
def test_sigterm_node_saves_within_grace_then_spare_takes_over(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    lines: list[str] = []
    spec = tiny_job("preempt", tmp_path, steps=STEPS)
    with quiet_run(spec, lines) as run:
        _wait_for_worker_at_step(run, 30)
        from orchestrator.state import jobs

        victim = jobs.read_status(run._client, spec.name).active_nodes[0]
        sent = time.time()
        run.signal_node(victim, signal.SIGTERM)
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    preempted = [e for e in result.events if e.type == "Preempted"]
    saved = [e for e in result.events if e.type == "Checkpoint" and "requested" in e.message]
    assert preempted and saved, summary(result, lines)
    grace = spec.fault_tolerance.preemption_grace.total_seconds()
    assert saved[0].time - sent < grace, "the preemption save came after the grace period"
    failed = [e for e in result.events if e.type == "NodeFailed"]
    assert [e.data.get("node") for e in failed] == [victim]
    assert result.recoveries == 1
    step = int(saved[0].data["step"])
    assert (tmp_path / "ckpt").exists() and any(
        f"{step:010d}" in p.name for p in (tmp_path / "ckpt").iterdir()
    ), "the preemption checkpoint is not on disk"
    assert_exactly_once(tmp_path, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), reference)


def test_compressed_job_survives_node_kill(tmp_path: Path) -> None:
    """The spec's comm hook is rebuilt, fresh on every rank, for each generation."""
    lines: list[str] = []
    comm = {"compression": {"type": "qsgd", "bits": 8, "warmup_steps": 5}}
    spec = tiny_job("qsgd", tmp_path, steps=80, comm=comm)
    with quiet_run(spec, lines, kill_node_at_step=30) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries == 1
    assert_exactly_once(tmp_path, 80)
