"""Training on a three-member etcd cluster while members die.

A real three-member etcd cluster (:mod:`tests.faults.etcd_cluster`) backs a
whole local job (controller, two active nodes, one spare, all separate
processes).  One member SIGKILLed is invisible: the clients fail over.  Two
members killed lose the quorum: the job pauses (workers hold their state at a
step boundary, agents keep them, the controller declares nobody dead), the
CLI names the endpoints it could not use, and when the members come back the
job resumes where it paused.  Either way the final parameters equal those of
a fault-free run and every step is applied exactly once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from orchestrator.etcd.options import EtcdOptions
from tests.chaos.jobs import REPO, assert_exactly_once, quiet_run, summary, tiny_job, wait_for_step
from tests.chaos.tiny_by_hand import tiny_final
from tests.faults.etcd_cluster import EtcdCluster

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 80


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """Final parameters of a fault-free run of the same job (computed here)."""
    return tiny_final(STEPS)


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7), f"{k} differs"


@pytest.mark.long  # short form: the soak's etcd-restart (chaos/test_soak.py)
def test_one_member_killed_training_goes_on(
    tmp_path: Path, cluster: EtcdCluster, reference: dict[str, torch.Tensor]
) -> None:
    lines: list[str] = []
    spec = tiny_job("one-member", tmp_path, steps=STEPS, step_time=0.05)
    with quiet_run(spec, lines, etcd=EtcdOptions(cluster.endpoints)) as run:
        wait_for_step(run, 20)
        cluster.kill(0)  # SIGKILL; the other two keep the quorum
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries == 0, summary(result, lines)
    assert not [e for e in result.events if e.type == "NodeFailed"]
    assert_exactly_once(tmp_path, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), reference)


def test_quorum_lost_job_pauses_then_resumes(
    tmp_path: Path, cluster: EtcdCluster, reference: dict[str, torch.Tensor]
) -> None:
    lines: list[str] = []
    # steps long enough that the outage lands mid-run: the status's step trails the
    # workers by a second or two (agents write progress about once a second)
    spec = tiny_job("no-quorum", tmp_path, steps=STEPS, step_time=0.15)
    with quiet_run(spec, lines, etcd=EtcdOptions(cluster.endpoints)) as run:
        wait_for_step(run, 20)
        cluster.kill(0)
        cluster.kill(1)
        # While there is no quorum the CLI says which endpoints it tried and why.
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "status",
                spec.name,
                "--etcd",
                ",".join(cluster.endpoints),
                "--etcd-timeout",
                "2",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={**_env(), "RINGMASTER_ETCD_OP_TIMEOUT": "2"},
        )
        time.sleep(4)  # longer than a lease TTL: leases would expire if etcd counted
        cluster.restart(0)
        cluster.restart(1)
        cluster.wait_healthy()
        result = run.wait()
    assert cli.returncode == 1, cli.stdout + cli.stderr
    for endpoint in cluster.endpoints:
        assert endpoint in cli.stderr, cli.stderr
    assert "etcd" in cli.stderr and "quorum" in cli.stderr, cli.stderr
    # the Paused phase may last milliseconds (the job can finish within the grace that
    # follows the outage), too short to poll for: its event is what stays
    paused = [e.message for e in result.events if e.type == "Phase" and "Paused" in e.message]
    assert paused and "etcd was unavailable" in paused[0], summary(result, lines)
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries == 0, summary(result, lines)
    assert not [e for e in result.events if e.type in ("NodeFailed", "WorkerExited")]
    phases = [e.message.split(":")[0] for e in result.events if e.type == "Phase"]
    # the job may finish within the grace that follows the outage (Paused -> Succeeded)
    assert phases[0] == "Running" and "Paused" in phases and phases[-1] == "Succeeded", phases
    # every active worker held its state at a step boundary, none was restarted
    held = [line for line in lines if "pausing until etcd is back" in line]
    assert len(held) >= 2, summary(result, lines)
    assert_exactly_once(tmp_path, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), reference)


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
