"""A job on an etcd that runs out of space: it pauses, and resumes once space is freed.

A real etcd with a small quota (``--quota-backend-bytes``) backs a whole local
job (controller, two active nodes, one spare, all separate processes).  While
the job trains, another client fills etcd until it raises its NOSPACE alarm
and refuses every write.  The job must pause (nobody declared dead, workers
holding their state at a step boundary) rather than fail; once the filler's
keys are deleted, the history compacted, the database defragmented and the
alarm disarmed, it goes on, and ends with the parameters of a fault-free run,
every step applied exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from orchestrator.api import JobPhase
from orchestrator.etcd.client import connect
from orchestrator.etcd.diagnosis import EtcdNoSpaceError
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary, tiny_job, wait_for_step
from tests.chaos.sharded_jobs import assert_same_params
from tests.chaos.tiny_by_hand import tiny_final

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 80
QUOTA = 16 * 1024 * 1024
FILL = b"f" * (256 * 1024)


@pytest.fixture
def small_etcd() -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd(quota_bytes=QUOTA) as server:
        yield server


# short form: the quorum loss's pause and resume (chaos/test_etcd_cluster.py); NOSPACE counted
# as etcd being away: integration/test_etcd_nospace.py
@pytest.mark.long
def test_nospace_pauses_the_job_and_it_resumes_after_compaction(
    tmp_path: Path, small_etcd: EmbeddedEtcd
) -> None:
    run_dir = tmp_path / "full"
    run_dir.mkdir()
    lines: list[str] = []
    # steps long enough that the outage lands mid-run (see test_etcd_cluster's quorum loss)
    spec = tiny_job("nospace", run_dir, steps=STEPS, step_time=0.15)
    filler = connect(EtcdOptions((small_etcd.endpoint,)))
    try:
        with quiet_run(spec, lines, etcd=EtcdOptions((small_etcd.endpoint,))) as run:
            wait_for_step(run, 15)
            # etcd sizes its database at each commit of a batch, so keys may go in
            # past the quota before the alarm: fill until a put is refused
            refused: int | None = None
            for i in range(8 * QUOTA // len(FILL)):
                try:
                    filler.put(f"/fill/{i:04d}", FILL)
                except EtcdNoSpaceError:
                    refused = i
                    break
            assert refused is not None, "etcd never ran out of space"
            lines.append(f"[test] etcd out of space after {refused} fill keys")
            time.sleep(4)  # longer than a lease TTL: leases would expire if etcd counted
            filler.delete_prefix("/fill/")
            filler.compact()
            filler.defragment()
            assert filler.disarm_no_space() == 1
            lines.append("[test] space freed, alarm disarmed")
            result = run.wait()
    finally:
        filler.close()
    paused = [e.message for e in result.events if e.type == "Phase" and "Paused" in e.message]
    assert paused and "etcd was unavailable" in paused[0], summary(result, lines)
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries == 0, summary(result, lines)
    assert not [e for e in result.events if e.type in ("NodeFailed", "WorkerExited")]
    # every active worker held its state at a step boundary, none was restarted
    held = [line for line in lines if "pausing until etcd is back" in line]
    assert len(held) >= 2, summary(result, lines)
    assert_exactly_once(run_dir, STEPS)
    assert_same_params(torch.load(run_dir / "final.pt"), tiny_final(STEPS))  # fault-free
