"""The restart tier's pure parts: torchrun's environment per generation, the
script's checkpoint directory, and the listening check on a real socket."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agents.node.restart_tier import torchrun_env
from agents.node.store_address import listening
from orchestrator.checkpoint_reach import script_checkpoint_dir
from orchestrator.records import Member, Plan
from orchestrator.spec import CheckpointSpec, EntrypointSpec, JobSpec

pytestmark = pytest.mark.unit


def _plan() -> Plan:
    return Plan(3, [Member("n1", 0, 2), Member("n0", 2, 2)], spares=["n2"])


def test_ranks_follow_the_plan_and_the_restart_count_is_the_generations() -> None:
    plan = _plan()
    env = torchrun_env(job="j", plan=plan, member=plan.members[1], local_rank=1,
                       master=("10.0.0.5", 29400), max_restarts=4,
                       error_file="/tmp/e.json")  # fmt: skip
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
    first = torchrun_env(job="j", plan=plan, member=plan.members[0], local_rank=0,
                         master=("h", 1), max_restarts=0, error_file="e")  # fmt: skip
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
