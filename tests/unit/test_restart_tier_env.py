"""The restart tier's pure parts: torchrun's environment per generation, the
script's checkpoint directory, the listening check on a real socket, what a node
reports of its workers' first output, and how the controller times a recovery by it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agents.node.restart_tier import (
    FIRST_OUTPUT_WAIT,
    RECOVERY_REFILL_DELAY,
    REFILL_DELAY,
    first_progress,
    refill_delay,
)
from agents.node.store_address import listening
from agents.node.torchrun_env import torchrun_env
from orchestrator.checkpoint_root.reach import script_checkpoint_dir
from orchestrator.controller.job import launched
from orchestrator.spec.job import CheckpointSpec, EntrypointSpec, JobSpec
from orchestrator.state.records import Member, NodeRecord, Plan

pytestmark = pytest.mark.unit


def _plan() -> Plan:
    return Plan(3, [Member("n1", 0, 2), Member("n0", 2, 2)], spares=["n2"])


def test_ranks_follow_the_plan_and_the_restart_count_is_the_generations() -> None:
    plan = _plan()
    env = torchrun_env(
        job="j",
        plan=plan,
        member=plan.members[1],
        local_rank=1,
        master=("10.0.0.5", 29400),
        max_restarts=4,
        error_file="/tmp/e.json",
    )
    assert env == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "ROLE_RANK": "3",
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": "4",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "j",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "4",
        "TORCHELASTIC_ERROR_FILE": "/tmp/e.json",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "RINGMASTER_RECOVERY": "restart",
    }
    first = torchrun_env(
        job="j",
        plan=plan,
        member=plan.members[0],
        local_rank=0,
        master=("h", 1),
        max_restarts=0,
        error_file="e",
    )
    assert (first["RANK"], first["GROUP_RANK"]) == ("0", "0")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("file:///data/ckpt", "/data/ckpt/script"),
        ("file://./ckpt/demo", "{work}/ckpt/demo/script"),
        ("ckpt", "{work}/ckpt/script"),
        ("s3://bucket/jobs/x/", "s3://bucket/jobs/x/script"),
    ],
)
def test_checkpoint_dir_is_under_the_jobs_checkpoint_url(
    url: str, expected: str, tmp_path: Path
) -> None:
    spec = JobSpec("j", EntrypointSpec(script="t.py"), checkpoint=CheckpointSpec(url=url))
    work = str(tmp_path)  # relative URLs are taken from the job's working directory
    assert script_checkpoint_dir(spec, work) == expected.format(work=work)


def test_listening_sees_a_listening_port_only() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not listening(port)  # bound, not listening: a store client would be refused
        s.listen()
        assert listening(port)


def test_progress_is_the_first_line_of_any_worker() -> None:
    assert first_progress(100.0, [100.9, 100.4], False, 101.0) == 100.4
    assert first_progress(100.0, [None, 100.4], False, 101.0) == 100.4  # rank 0 prints alone
    assert first_progress(100.0, [None, None], False, 101.0) == 0.0  # not yet
    assert first_progress(100.0, [], False, 101.0) == 0.0


def test_silent_workers_are_reported_as_not_telling() -> None:
    late = 100.0 + FIRST_OUTPUT_WAIT + 0.1
    assert first_progress(100.0, [None, None], False, late) is None
    assert first_progress(100.0, [None, None], True, 100.5) is None  # exited without a line


def _node(generation: int, launched_at: float, progress_at: float | None) -> NodeRecord:
    return NodeRecord(
        host="h",
        address="a",
        slots=2,
        pid=7,
        worker_pids=[],
        started=1.0,
        generation=generation,
        launched_at=launched_at,
        progress_at=progress_at,
    )


def test_a_recovery_ends_at_the_first_output_any_agent_saw() -> None:
    plan = _plan()
    nodes = {"n1": _node(3, 10.0, 10.7), "n0": _node(3, 10.2, None)}
    progress = launched(plan, nodes)
    assert sorted(progress) == ["n0-0", "n0-1", "n1-0", "n1-1"]
    told, silent = progress["n1-0"].telemetry, progress["n0-1"].telemetry
    assert (told.group_formed_at, told.restored_at, told.first_step_at) == (10.0, 10.7, 10.7)
    assert (silent.group_formed_at, silent.first_step_at) == (10.2, 10.7)  # the group's
    nodes["n1"] = _node(3, 10.0, None)
    assert launched(plan, nodes)["n1-0"].telemetry.first_step_at == 10.0  # nobody told
    assert launched(plan, {"n1": _node(2, 10.0, 10.7)}) == {}  # an older generation's launch


def test_used_standbys_are_replaced_later_after_a_recovery_than_at_the_start() -> None:
    # at the job's start soon (an early failure finds them warm); after a relaunch only
    # once the new workers have had time to load and step without the imports beside them
    assert refill_delay(1) == REFILL_DELAY < 2.0
    assert refill_delay(2) == refill_delay(7) == RECOVERY_REFILL_DELAY >= 5.0
