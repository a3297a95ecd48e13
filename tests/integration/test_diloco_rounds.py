"""Outer syncs as rounds in real local jobs: a slow site left out by a quorum, a stop
agreed in a round.

Two sites of one node each (``zone`` a: node-0, b: node-1), separate processes
talking gloo, on a real etcd; the rounds go through the generation's real
``TCPStore``.  Site b takes 0.2 s more per step than site a, a whole inner
period (1 s) behind it by the first outer sync, and ``sync.quorum`` is 1 with
a ``sync_timeout`` of 0.1 s: site a goes ahead without b, b comes to the
round afterwards, takes the same outer step without its own pseudo-gradient
in it (left out) and keeps its inner steps for its next round.  Every outer
step is taken once on each site (the same count), and both end on the same
global model.  No vote crosses the sites between outer syncs: a stop reaches
them in the next round's agreement, and every site stops (and saves) at the
boundary where that round finishes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs, keys, records
from orchestrator.state.checkpoint_record import CheckpointRecord
from tests.chaos.jobs import quiet_run, step_log, summary, tiny_job, wait_for_step

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
STEPS, INNER = 15, 5
ZONES = {"node-0": {"zone": "a"}, "node-1": {"zone": "b"}}


def test_a_slow_site_is_left_out_of_outer_syncs_and_every_step_is_taken_once(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = ["--out-dir", str(out), "--slow", "node-1", "--slow-time", "0.2"]
    base = tiny_job(
        "quorum",
        tmp_path,
        steps=STEPS,
        spares=0,
        script=REPO / "tests" / "integration" / "quorum_worker.py",
        extra_args=args,
    ).to_dict()
    base["entrypoint"]["args"] = args  # the worker takes none of train_tiny's
    base["sync"] = {"mode": "diloco", "inner_steps": INNER, "quorum": 1, "sync_timeout": "100ms"}
    lines: list[str] = []
    with quiet_run(load_job_data(base), lines, node_labels=ZONES) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    records = {r["node"]: r for r in (json.loads(p.read_text()) for p in out.glob("*.json"))}
    fast, slow = records["node-0"], records["node-1"]
    assert fast["outer_steps"] == slow["outer_steps"] == [STEPS // INNER]
    assert fast["left_out"] == 0, "the fast site is never waited out"
    assert slow["left_out"] >= 1, "the slow site came after the quorum went ahead"
    assert fast["params"] == slow["params"], "both sites end on the one global model"


def test_a_stop_is_agreed_in_an_outer_sync_and_every_site_saves_and_stops_there(
    tmp_path: Path,
) -> None:
    base = tiny_job("rounds-stop", tmp_path, steps=1000, spares=0, step_time=0.05).to_dict()
    base["sync"] = {"mode": "diloco", "inner_steps": INNER}
    lines: list[str] = []
    with quiet_run(load_job_data(base), lines, node_labels=ZONES) as run:
        wait_for_step(run, 2 * INNER + 2)
        jobs.request_stop(run.client, "rounds-stop")
        result = run.wait()
        saved = records.read(run.client, keys.job_checkpoint("rounds-stop"), CheckpointRecord)
    assert result.phase is JobPhase.STOPPED, summary(result, lines)
    last = {worker: steps[-1] for worker, steps in step_log(tmp_path).items()}
    assert len(last) == 2 and len(set(last.values())) == 1, last  # one step on both sites
    stopped_at = next(iter(last.values())) + 1
    assert stopped_at % INNER == 0, last  # where an outer sync finished
    assert saved is not None and saved.step == stopped_at, (saved, last)
