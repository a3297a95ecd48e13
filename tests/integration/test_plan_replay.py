"""A real run's own records replayed through the planner's simulator.

A local job (etcd, a controller, 2 nodes + 2 warm spares as processes) has a
whole node SIGKILLed twice; :func:`~orchestrator.planning.from_run.recorded_run`
reads its recoveries and its measured effective training back from etcd and
:mod:`orchestrator.planning.replay` replays them.  What is asserted holds on a
loaded machine: the replay uses the run's fault times and costs, its accounts
close, and it predicts the measured effective training within 3 points (the
replay charges what the measure charges, so only the accounts can differ).
How close the model (a warm swap's median cost) comes is printed by
``benchmarks/goodput_at_scale.py --from-run``, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.local_run import LocalRun
from orchestrator.observe.records import RecoveryRecord
from orchestrator.planning.api import Tier
from orchestrator.planning.costs import Measured
from orchestrator.planning.from_run import recorded_run
from orchestrator.planning.replay import effective, model, replay, warm_stop_from
from orchestrator.state import jobs, keys, records
from tests.chaos.jobs import REPO, quiet_run, summary, tiny_job

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS, FIRST_KILL, SECOND_KILL = 240, 60, 150


def _kill_again(run: LocalRun, stop: threading.Event) -> None:
    """SIGKILL a second active node once the job trains again past SECOND_KILL."""
    while not stop.is_set():
        status = jobs.read_status(run.client, run.spec.name)
        if (
            status is not None
            and status.recoveries >= 1
            and status.phase is JobPhase.RUNNING
            and status.step >= SECOND_KILL
            and status.active_nodes
        ):
            run.kill_node(status.active_nodes[0])
            return
        stop.wait(0.05)


def test_a_recorded_run_replays_to_its_measured_effective_training(
    tmp_path: Path, etcd: EmbeddedEtcd
) -> None:
    spec = tiny_job("replayed", tmp_path, steps=STEPS, spares=2)
    lines: list[str] = []
    options = EtcdOptions((etcd.endpoint,))
    stop = threading.Event()
    with quiet_run(
        spec, lines, etcd=options, kill_node_at_step=FIRST_KILL, timeout=timedelta(seconds=200)
    ) as run:
        killer = threading.Thread(target=_kill_again, args=(run, stop), daemon=True)
        killer.start()
        result = run.wait()
        stop.set()
        killer.join(timeout=5)
        assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
        recorded = recorded_run(run.client, spec.name)
        status = jobs.read_status(run.client, spec.name)
        found = records.read_all(run.client, keys.job_recoveries(spec.name), RecoveryRecord)
        bench = subprocess.run(
            [
                sys.executable,
                str(REPO / "benchmarks" / "goodput_at_scale.py"),
                "--smoke",
                "--skip-validate",
                "--from-run",
                spec.name,
                "--etcd",
                etcd.endpoint,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert status is not None and status.training_time is not None
    measured = status.training_time
    recoveries = sorted(found.values(), key=lambda r: r.failure_at)
    assert len(recoveries) == 2, summary(result, lines)
    # the replay's faults are the run's: its recoveries' times and costs
    assert recorded.tier is Tier.IN_PROCESS and (recorded.nodes, recorded.spares) == (2, 2)
    first = status.train_started_at
    assert first is not None
    assert [f.at for f in recorded.faults] == pytest.approx(
        [r.failure_at - first for r in recoveries]
    )
    assert [f.stop_s for f in recorded.faults] == pytest.approx([r.total_s for r in recoveries])
    assert all(f.warm_spare and f.waited_s == 0 for f in recorded.faults)
    assert recorded.measured == measured.effective
    assert recorded.window_s == measured.since_first_step_s
    # its accounts close: work done plus every loss is the simulated time
    sim = replay(recorded)
    lost_s = sum(sim.lost_gpu_h.values()) * 3600 / recorded.nodes
    assert sim.ettr * sim.horizon_s + lost_s == pytest.approx(sim.horizon_s)
    assert sim.faults == {"crash": 2}
    predicted = effective(recorded, sim)
    warm = warm_stop_from([recorded])
    assert warm is not None
    modelled = effective(recorded, model(recorded, warm, Measured().spare_warmup_s))
    print(
        f"replayed: predicted {predicted:.2%} (model {modelled:.2%}), "
        f"measured {measured.effective:.2%} "
        f"(recoveries {[round(r.total_s, 2) for r in recoveries]} s, "
        f"window {measured.since_first_step_s:.1f} s)"
    )
    assert predicted == pytest.approx(measured.effective, abs=0.03)
    # the benchmark prints the same replay, and the model beside it
    assert bench.returncode == 0, bench.stderr
    assert f"replay of job {spec.name}'s records" in bench.stdout
    (row,) = json.loads(bench.stdout.splitlines()[-1])["from_run"]
    assert row["replay"] == pytest.approx(predicted, abs=1e-4)
    assert row["measured"] == pytest.approx(measured.effective, abs=1e-4)
    assert "model" in row and row["kills"] == 2
