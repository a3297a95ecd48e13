"""Chaos soak: many faults of every kind in one run; nothing completed is lost.

The job runs on a 3-member etcd cluster.  The short form (7 faults, one of
each kind) runs in ``make test``;
``make chaos`` sets ``RINGMASTER_SOAK_FAULTS=12`` for the long form.  At the
end: the job succeeded, its final parameters equal a fault-free run's
(computed in the test: :mod:`tests.chaos.tiny_by_hand`), every
step was applied exactly once, and every checkpoint listed as committed
verifies.  Replay a run with ``RINGMASTER_SOAK_SEED=<seed printed>``.

The job swaps stragglers for warm spares (``fault_tolerance.stragglers.action:
swap``): no fault of the soak slows a node while it keeps stepping, so no
node may be swapped as a straggler (a false swap), whatever the faults do to
the step times around them.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch

from checkpoint import catalog
from orchestrator.api import JobPhase
from orchestrator.etcd.options import EtcdOptions
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs
from tests.chaos.jobs import REPO, assert_exactly_once, quiet_run, summary
from tests.chaos.soak import KINDS, Injector, plan_faults
from tests.chaos.tiny_by_hand import tiny_final
from tests.faults.etcd_cluster import EtcdCluster

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]

FAULTS = int(os.environ.get("RINGMASTER_SOAK_FAULTS", str(len(KINDS))))
SEED = int(os.environ.get("RINGMASTER_SOAK_SEED", "0")) or random.SystemRandom().randrange(1, 10**6)
FIRST, GAP, CKPT_EVERY = 20, 60, 30
STEPS = FIRST + FAULTS * GAP + 150  # room for faults that wait for a warm spare
HOLD_AT = STEPS - 40  # the workers wait there until every fault is in (tests/chaos/soak.py)


def soak_job(name: str, tmp: Path) -> JobSpec:
    (tmp / "steps").mkdir(parents=True, exist_ok=True)
    # examples/train_tiny.py with slow checkpoint writes (tests/chaos/soak_worker.py)
    script = REPO / "tests/chaos/soak_worker.py"
    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(script),
                "args": [
                    "--step-time",
                    "0.05",
                    "--out",
                    str(tmp / "final.pt"),
                    "--step-log",
                    str(tmp / "steps"),
                    "--hold-at",
                    str(HOLD_AT),
                    "--go-file",
                    str(tmp / "go"),
                ],
                "env": {"RINGMASTER_LOG_EVERY": "1000", "RINGMASTER_TEST_SLOW_WRITE_S": "0.4"},
            },
            "nodes": {"min": 2, "max": 2, "spares": 2},
            "max_steps": STEPS,
            "checkpoint": {
                "url": f"file://{tmp}/ckpt",
                "every_steps": CKPT_EVERY,
                "keep": 1000,
            },
            "fault_tolerance": {
                "hang_timeout": "3s",
                "heartbeat_interval": "500ms",
                "preemption_grace": "20s",
                "max_restarts": 20,
                "stragglers": {"action": "swap"},
            },
        }
    )


def test_soak_every_fault_kind_nothing_lost(tmp_path: Path) -> None:
    faults = plan_faults(SEED, FAULTS, FIRST, GAP)
    schedule = ", ".join(f"{f.kind}@{f.at_step}" for f in faults)
    print(f"soak seed {SEED}: {schedule}")

    run_dir = tmp_path / "soak"
    lines: list[str] = []
    spec = soak_job("soak", run_dir)
    with (
        EtcdCluster(3) as cluster,
        quiet_run(spec, lines, controllers=2, etcd=EtcdOptions(cluster.endpoints)) as run,
    ):
        injector = Injector(
            run, faults, run_dir / "ckpt", random.Random(SEED), cluster, HOLD_AT, run_dir / "go"
        )
        client = run._client
        assert client is not None
        deadline = time.monotonic() + 780
        while time.monotonic() < deadline:
            injector.poll()
            status = jobs.read_status(client, spec.name)
            if status is not None and status.phase.terminal:
                break
            time.sleep(0.1)
        injector.release()  # (given up: the asserts below say which fault never went in)
        result = run.wait()
    report = f"seed {SEED}; injected: {', '.join(map(str, injector.done))}"
    assert result.phase is JobPhase.SUCCEEDED, report + "\n" + summary(result, lines)
    assert not injector.pending, f"{report}; never injected: {injector.pending}"
    assert {f.kind for f in injector.done} == set(KINDS)
    assert_exactly_once(run_dir, STEPS)
    calls = [e.message for e in result.events if e.type == "Straggler"]
    swaps = [e.message for e in result.events if e.type == "StragglerSwapped"]
    print(f"soak straggler calls: {len(calls)}, swaps: {len(swaps)}: {calls + swaps}")
    assert not swaps, f"{report}: false straggler swaps: {swaps}"

    a, b = tiny_final(STEPS), torch.load(run_dir / "final.pt")  # a fault-free run's
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7), f"{report}: {k} differs"

    infos = catalog.checkpoints(f"file://{run_dir}/ckpt")
    committed = [i for i in infos if i.committed]
    assert committed, report
    for info in committed:
        verdict = catalog.verify(info.url)
        assert verdict.ok, f"{report}: committed checkpoint {info.name} fails: {verdict.problems}"
