"""The in-process tier's end, with a real etcd and real worker processes: once the
job's run is over, a worker past its training loop runs the rest of its script (a
final evaluation) to its end; a worker still inside it is stopped after the short
grace.

Before, both were stopped :data:`~agents.node.in_process_tier.ENDED_GRACE`
seconds after the job was marked Succeeded, which one site's first finished rank
does: a rank of another site still evaluating its model was killed half-way.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

from agents.node import in_process_tier
from agents.node.api import Outcome, TierSetup
from agents.node.in_process_tier import InProcessTier
from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.spec.loader import load_job_data
from orchestrator.state import keys, records
from orchestrator.state.records import DoneRecord, JobStatus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

#: The worker: blocks reading a FIFO until the test writes to it, then exits 0.
SCRIPT = "import sys\nopen(sys.argv[1]).read()\n"


def _tier(client: EtcdClient, tmp: Path, job: str, fifo: Path) -> tuple[InProcessTier, Path]:
    script = tmp / "after_loop.py"
    script.write_text(SCRIPT)
    spec = load_job_data(
        {
            "name": job,
            "entrypoint": {"script": str(script), "args": [str(fifo)]},
            "nodes": {"min": 1, "max": 1},
            "fault_tolerance": {"hang_timeout": "120s"},
        }
    )
    setup = TierSetup(
        client=client,
        job=job,
        node="node-0",
        run=1,
        spec=spec,
        workdir=str(tmp),
        errors_dir=tmp,
        stop=threading.Event(),
        worker_env=lambda _: {**os.environ, "OMP_NUM_THREADS": "1"},
        register=lambda: None,
    )
    tier = InProcessTier(setup)
    tier.start()
    return tier, script


def _ended(
    client: EtcdClient, tmp: Path, prefix: str, done_after_start: float
) -> tuple[InProcessTier, Path]:
    """A tier whose one worker blocks on a FIFO, a done record for that worker's slot
    ``done_after_start`` seconds after the worker started, and the job Succeeded."""
    job = f"{prefix}-{uuid.uuid4().hex[:8]}"
    fifo = tmp / "release"
    os.mkfifo(fifo)
    tier, _ = _tier(client, tmp, job, fifo)
    at = tier.workers[0].started_at + done_after_start
    done = DoneRecord(step=10, generation=1, at=at)
    records.write(client, keys.job_done(job) + keys.worker_id("node-0", 0), done)
    records.write(client, keys.job_status(job), JobStatus(job, JobPhase.SUCCEEDED, run=1))
    return tier, fifo


def _supervise(tier: InProcessTier) -> tuple[threading.Thread, list[Outcome]]:
    outcome: list[Outcome] = []
    thread = threading.Thread(target=lambda: outcome.append(tier.supervise()), daemon=True)
    thread.start()
    return thread, outcome


@pytest.fixture
def no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The short grace made nil and the phase read often, so that only the rule decides."""
    monkeypatch.setattr(in_process_tier, "ENDED_GRACE", 0.0)
    monkeypatch.setattr(in_process_tier, "PHASE_POLL", 0.05)


@pytest.mark.usefixtures("no_grace")
def test_a_worker_past_its_loop_finishes_its_script_after_the_job_succeeded(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    tier, fifo = _ended(etcd_client, tmp_path, "tail", done_after_start=0.5)
    waited = threading.Event()
    grace = tier._ended_grace

    def seen() -> float:  # the rule's answer, once it said "wait for the worker"
        value = grace()
        if value > 0:
            waited.set()
        return value

    tier._ended_grace = seen  # type: ignore[method-assign]
    worker = tier.workers[0]
    thread, outcome = _supervise(tier)
    try:
        assert waited.wait(20), "the tier never weighed the finished worker's own grace"
        assert worker.exit_code() is None, "the worker past its loop was stopped"
        fifo.write_text("go\n")  # the script's tail ends by itself
        thread.join(20)
        assert not thread.is_alive()
    finally:
        tier.setup.stop.set()
        thread.join(10)
        tier.close()
    assert outcome == [Outcome("workers finished (job Succeeded)")]
    assert worker.exit_code() == 0


@pytest.mark.usefixtures("no_grace")
def test_a_worker_still_in_its_loop_is_stopped_once_the_job_succeeded(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    # a done record of an earlier worker on this slot is not this one's
    tier, _ = _ended(etcd_client, tmp_path, "loop", done_after_start=-60)
    thread, outcome = _supervise(tier)
    try:
        thread.join(30)
        assert not thread.is_alive(), "the tier kept waiting for a worker inside its loop"
    finally:
        tier.setup.stop.set()
        thread.join(10)
        tier.close()
    assert len(outcome) == 1 and "1 worker(s) still running" in outcome[0].reason, outcome
    assert outcome[0].exit_code == 0
