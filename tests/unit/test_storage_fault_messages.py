"""The words of storage faults and of a run's end: one line, the cause, only advice that works."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from orchestrator.api import JobPhase
from orchestrator.cli.job_commands import checkpoint_cell
from orchestrator.observe.endings import agents_gone_message, unsaved
from orchestrator.spec.api import SpecError
from orchestrator.spec.checkpoint import DEFAULT_FINAL_WAIT, CheckpointSpec
from orchestrator.spec.loader import load_job_data
from orchestrator.state.records import Event, JobStatus

pytestmark = pytest.mark.unit

LEASE = "lease expired: node-0; 0 nodes left, need 1"
EXITED = Event(
    "WorkerExited",
    "node-0-1 exit code 1: ValueError: bad learning rate",
    source="node-0",
    data={"error": "exit code 1: ValueError: bad learning rate"},
)


def test_agents_gone_names_the_first_error_and_no_resume_without_a_checkpoint() -> None:
    status = JobStatus("j", phase=JobPhase.RECOVERING, message=LEASE)
    text = agents_gone_message("j", status, [Event("Run", "run 1"), EXITED])
    assert "\n" not in text
    assert "the first error: node-0-1 exit code 1: ValueError: bad learning rate" in text
    assert "ringmaster resume" not in text and "committed no checkpoint" in text


def test_agents_gone_suggests_resume_only_from_a_committed_checkpoint() -> None:
    status = JobStatus("j", phase=JobPhase.RECOVERING, message=LEASE)
    status.last_checkpoint = "step 40 (periodic)"
    text = agents_gone_message("j", status, [EXITED])
    assert "once that is fixed, `ringmaster resume j`" in text and "step 40" in text
    quiet = agents_gone_message("j", status, [])
    assert "no worker reported an error" in quiet and "`ringmaster resume j`" in quiet


def test_a_save_left_uploading_names_the_newest_durable_checkpoint() -> None:
    status = JobStatus("j", last_checkpoint="step 10 (periodic)")
    assert unsaved(status) == ""
    status.uploading = (20, time.time() - 95)
    assert unsaved(status) == (
        "; step 20 was not saved, the newest durable checkpoint is step 10 (periodic)"
    )
    # the heartbeat said uploading, the commit came since: nothing is left unsaved
    assert unsaved(status, committed=20) == ""
    assert checkpoint_cell(status).endswith("; step 20 uploading for 95 s")
    status.phase = JobPhase.SUCCEEDED
    assert "uploading" not in checkpoint_cell(status)


def test_checkpoint_failure_policy_fields_load_and_are_checked() -> None:
    base = {"name": "j", "entrypoint": {"script": "train.py"}}
    spec = load_job_data(base)
    assert spec.checkpoint.max_consecutive_failures == 0
    assert spec.checkpoint.final_wait == DEFAULT_FINAL_WAIT < timedelta(minutes=1)
    spec = load_job_data(
        {**base, "checkpoint": {"max_consecutive_failures": 3, "final_wait": "5s"}}
    )
    assert spec.checkpoint.max_consecutive_failures == 3
    assert spec.checkpoint.final_wait == timedelta(seconds=5)
    problems = dict(CheckpointSpec(max_consecutive_failures=-1, final_wait=timedelta(0)).problems())
    assert "must be 0" in problems["max_consecutive_failures"]
    assert "positive" in problems["final_wait"]
    with pytest.raises(SpecError, match="max_consecutive_failures"):
        load_job_data({**base, "checkpoint": {"max_consecutive_failures": -2}})


@pytest.mark.parametrize("url", ["", "   "])
def test_an_empty_checkpoint_url_is_refused(url: str) -> None:
    """It resolved to the working directory's own path in silence."""
    base = {"name": "j", "entrypoint": {"script": "train.py"}}
    with pytest.raises(SpecError, match=r"checkpoint.url: is empty: give a directory"):
        load_job_data({**base, "checkpoint": {"url": url}})
