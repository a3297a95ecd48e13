"""``checkpoint.every_seconds`` alone makes periodic saves.

The job has no ``every_steps``; it trains for several seconds, so with
``every_seconds: 2`` the ranks agree (at a step boundary, through the
control vote of :mod:`agents.runtime.boundary`) on at least one periodic save, which
commits a checkpoint and is recorded in etcd.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from pathlib import Path

import pytest

from checkpoint.catalog import checkpoints
from orchestrator.api import JobPhase
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.spec.loader import load_job_data
from orchestrator.state import keys, records
from orchestrator.state.records import CheckpointRecord
from tests.chaos.jobs import REPO, quiet_run, summary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 60
STEP_TIME = 0.05  # at least 3 s of training: saves at 1 s, 2 s (and on)


def test_every_seconds_commits_checkpoints_without_every_steps(
    tmp_path: Path, etcd: EmbeddedEtcd
) -> None:
    url = f"file://{tmp_path}/ckpt"
    spec = load_job_data(
        {
            "name": "every-seconds",
            "entrypoint": {
                "script": str(REPO / "examples" / "train_tiny.py"),
                "args": ["--step-time", str(STEP_TIME)],
                "env": {"RINGMASTER_LOG_EVERY": "1000"},
            },
            "nodes": {"min": 2, "max": 2, "spares": 0},
            "max_steps": STEPS,
            "checkpoint": {"url": url, "every_seconds": 1, "keep": 10},
            "fault_tolerance": {"heartbeat_interval": "500ms"},
        }
    )
    assert spec.checkpoint.every_steps == 0
    lines: list[str] = []
    options = EtcdOptions((etcd.endpoint,))
    with quiet_run(spec, lines, etcd=options, timeout=timedelta(seconds=120)) as run:
        result = run.wait()
        recorded = records.read(run.client, keys.job_checkpoint(spec.name), CheckpointRecord)
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    committed = [c for c in checkpoints(url) if c.committed]
    assert committed, f"no committed checkpoint under {url}: {checkpoints(url)}"
    assert all(0 < c.step < STEPS for c in committed), [c.step for c in committed]
    # saves follow the clock, not a step count: never one right after another
    steps = [c.step for c in committed]
    assert all(b - a >= 10 for a, b in itertools.pairwise(steps)), steps
    assert recorded is not None and recorded.reason == "periodic", recorded
