"""The Slurm door without a cluster: the job file's ``slurm`` section, the batch script,
the agents' srun line, what scontrol prints, and the CLI's ``script`` command."""

from __future__ import annotations

import shlex
import signal
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.slurm.allocation import AllocationResult
from orchestrator.slurm.api import Allocation, NodeState, NotInAllocationError, SlurmCommandError
from orchestrator.slurm.scontrol_text import (
    parse_job_id,
    parse_node,
    parse_record,
    topology_labels,
)
from orchestrator.slurm.script import (
    agent_command,
    agent_step,
    batch_script,
    directives,
    with_overrides,
)
from orchestrator.spec.api import SpecError
from orchestrator.spec.loader import load_job_text
from orchestrator.spec.slurm import slurm_time_seconds

pytestmark = pytest.mark.unit

JOB = """\
name: demo
entrypoint: train.py
nodes: {min: 2, max: 4, spares: 2}
"""


def job(extra: str = "") -> str:
    return JOB + extra


# ---------------------------------------------------------------------------- the section


def test_the_slurm_section_is_read_in_either_spelling() -> None:
    spec = load_job_text(
        job(
            "slurm:\n  partition: gpu\n  gpusPerNode: 8\n  time: '2-00:00:00'\n"
            "  signal_grace: 5m\n  modules: [cuda/12.4, nccl]\n  extra: [--constraint=a100]\n"
            "  requeue: false\n"
        )
    )
    s = spec.slurm
    assert (s.partition, s.gpus_per_node, s.time) == ("gpu", 8, "2-00:00:00")
    assert s.signal_grace == timedelta(minutes=5) and not s.requeue
    assert s.modules == ["cuda/12.4", "nccl"] and s.extra == ["--constraint=a100"]
    assert spec.to_dict()["slurm"]["signal_grace"] == 300


def test_bad_slurm_fields_are_each_named_with_what_to_do() -> None:
    with pytest.raises(SpecError) as e:
        load_job_text(
            job(
                "slurm:\n  time: 'soon'\n  partition: 'gpu; rm -rf /'\n  gpus_per_node: -1\n"
                "  extra: [constraint=a100, --nodes=9, -N9]\n  modules: ['a b']\n"
                "  sigal_grace: 1\n"
            ),
            source="job.yaml",
        )
    text = str(e.value)
    assert "job.yaml:5: slurm.time: 'soon' is not a Slurm time limit" in text
    assert "slurm.partition: 'gpu; rm -rf /' is not a Slurm partition name" in text
    assert "slurm.gpus_per_node: must be 0 or more, got -1" in text
    assert "slurm.extra[0]: 'constraint=a100' is not an sbatch option" in text
    assert "slurm.extra[1]: --nodes is set by ringmaster (nodes.max + nodes.spares)" in text
    assert "slurm.extra[2]: -N is set by ringmaster" in text
    assert "slurm.modules[0]: 'a b' is not a module name" in text
    assert "slurm.sigal_grace" in text and "signal_grace" in text  # did you mean


def test_the_grace_must_fit_in_the_time_limit_and_in_slurms_bound() -> None:
    with pytest.raises(SpecError, match="must be shorter than the time limit"):
        load_job_text(job("slurm: {time: '1', signal_grace: 90}\n"))
    with pytest.raises(SpecError, match="must be 1s to 65535s"):
        load_job_text(job("slurm: {signal_grace: 70000}\n"))
    load_job_text(job("slurm: {time: UNLIMITED, signal_grace: 600}\n"))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 5400),
        ("5:30", 330),
        ("1:00:00", 3600),
        ("2-12", 216000),
        ("1-00:30", 88200),
        ("1-00:00:10", 86410),
        ("x", None),
        ("1:2:3:4", None),
    ],
)
def test_slurm_time_forms(text: str, seconds: int | None) -> None:
    assert slurm_time_seconds(text) == seconds


# ---------------------------------------------------------------------------- the script


def test_the_batch_script_asks_for_every_node_and_survives_a_lost_one() -> None:
    spec = load_job_text(
        job(
            "slurm:\n  partition: gpu\n  account: ml\n  time: '4:00:00'\n  gpus_per_node: 8\n"
            "  modules: [cuda/12.4]\n  setup: ['source /shared/venv/bin/activate']\n"
            "  extra: ['--constraint=a100']\n"
        )
    )
    text = batch_script(
        spec,
        "/shared/job.yaml",
        workdir="/shared/work dir",
        ringmaster=["/shared/venv/bin/python", "-m", "orchestrator.cli"],
    )
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH ")]
    assert sbatch[:9] == [
        "--job-name=demo",
        "--nodes=6",  # nodes.max + nodes.spares
        "--ntasks-per-node=1",
        "--no-kill",
        "--requeue",
        "--signal=B:USR1@120",
        "--open-mode=append",
        "--output=ringmaster-%x-%j.out",
        '--chdir="/shared/work dir"',  # sbatch splits an unquoted value at the space
    ]
    for option in (
        "--exclusive",
        "--partition=gpu",
        "--account=ml",
        "--time=4:00:00",
        "--gpus-per-node=8",
        "--constraint=a100",
    ):
        assert option in sbatch
    body = lines[len(sbatch) + 3 :]
    assert "module load cuda/12.4" in body
    assert body.index("module load cuda/12.4") < body.index("source /shared/venv/bin/activate")
    last = [line for line in lines if line.startswith("exec ")]
    assert shlex.split(last[0]) == [
        "exec",
        "/shared/venv/bin/python",
        "-m",
        "orchestrator.cli",
        "slurm",
        "run",
        "/shared/job.yaml",
    ]


def test_no_requeue_shared_nodes_and_a_named_etcd() -> None:
    spec = with_overrides(load_job_text(job()), requeue=False, exclusive=False)
    options = directives(spec, workdir="/w")
    assert "--no-requeue" in options and "--requeue" not in options
    assert "--exclusive" not in options
    text = batch_script(spec, "/w/j.yaml", workdir="/w", ringmaster=["rm"], etcd=["e1:2379"])
    assert text.rstrip().endswith("exec rm slurm run /w/j.yaml --etcd e1:2379")


def test_command_line_overrides_replace_fields_and_add_to_lists() -> None:
    spec = load_job_text(job("slurm: {partition: cpu, modules: [a]}\n"))
    out = with_overrides(
        spec, partition="gpu", modules=("b",), time=None, signal_grace=timedelta(seconds=30)
    )
    assert out.slurm.partition == "gpu" and out.slurm.modules == ["a", "b"]
    assert out.slurm.signal_grace == timedelta(seconds=30)
    with pytest.raises(SpecError, match=r"slurm.time: 'later' is not a Slurm time limit"):
        with_overrides(spec, time="later")


def test_the_agents_step_keeps_going_without_a_lost_node() -> None:
    command = agent_command(["python", "-m", "orchestrator.cli"], "demo", ["--etcd", "h:1"])
    argv = agent_step(6, command)
    assert argv[0] == "srun"
    for option in (
        "--nodes=6",
        "--ntasks=6",
        "--ntasks-per-node=1",
        "--no-kill",
        "--kill-on-bad-exit=0",
        "--wait=0",
    ):
        assert option in argv
    assert argv[-9:] == [
        *("python", "-m", "orchestrator.cli", "slurm", "agent"),
        *("--job", "demo", "--etcd", "h:1"),
    ]


def test_script_command_prints_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("print('hi')\n")
    Path("job.yaml").write_text(job("fault_tolerance: {recovery: restart}\n"))
    runner = CliRunner()
    argv = ["slurm", "script", "job.yaml", "-p", "gpu", "--time", "1:00:00", "--python", "py"]
    done = runner.invoke(main, argv)
    assert done.exit_code == 0, done.output
    assert "#SBATCH --partition=gpu" in done.output
    assert "#SBATCH --time=1:00:00" in done.output
    assert f"exec py -m orchestrator.cli slurm run {tmp_path / 'job.yaml'}" in done.output
    bad = runner.invoke(main, ["slurm", "script", "job.yaml", "--time", "soon"])
    assert bad.exit_code == 2 and "slurm.time: 'soon' is not a Slurm time limit" in bad.output


def test_run_outside_an_allocation_says_how_to_submit() -> None:
    with pytest.raises(NotInAllocationError, match="ringmaster slurm submit"):
        Allocation.from_environ({})
    alloc = Allocation.from_environ(
        {
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_NUM_NODES": "3",
            "SLURM_JOB_NODELIST": "n[1-3]",
            "SLURMD_NODENAME": "n1",
            "SLURM_RESTART_COUNT": "2",
        }
    )
    assert alloc == Allocation("7", 3, "n[1-3]", "n1", 2)


def test_the_batch_scripts_exit_status_is_the_jobs() -> None:
    from orchestrator.api import JobPhase
    from orchestrator.local_run import RunResult

    def result(phase: JobPhase, sig: int | None = None, requeued: bool = False) -> int:
        run = RunResult(phase, step=1, recoveries=0, wall_s=1.0)
        return AllocationResult(run, signal=sig, requeued=requeued).exit_code

    assert result(JobPhase.SUCCEEDED) == 0
    assert result(JobPhase.FAILED) == 1
    assert result(JobPhase.STOPPED, signal.SIGTERM) == 128 + signal.SIGTERM
    assert result(JobPhase.STOPPED, signal.SIGUSR1, requeued=True) == 0


# ---------------------------------------------------------------------------- scontrol


NODE = (
    "NodeName=node4 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 NodeAddr=10.0.0.4 "
    "NodeHostName=vm Port=17834 OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2000 "
    "State={state} ThreadsPerCore=1 Partitions=debug  CfgTRES=cpu=2,mem=2000M,billing=2 "
    "AllocTRES= Reason={reason}"
)


def test_a_drained_node_is_told_from_one_that_is_down() -> None:
    drained = parse_node(
        NODE.format(state="MIXED+DRAIN", reason="disk swap [root@2026-12-02T04:16:00]")
    )
    assert drained == NodeState(
        "node4", "MIXED", frozenset({"DRAIN"}), "disk swap", address="10.0.0.4"
    )
    assert drained.leaving and not drained.down
    assert drained.describe() == "MIXED+DRAIN (disk swap)"
    down = parse_node(NODE.format(state="DOWN+NOT_RESPONDING", reason="Not responding"))
    assert down.down and not down.leaving
    reboot = parse_node(NODE.format(state="ALLOCATED+DRAIN+REBOOT_REQUESTED", reason="kernel"))
    assert reboot.leaving
    assert not parse_node(NODE.format(state="ALLOCATED", reason="")).leaving
    record = parse_record(NODE.format(state="IDLE", reason="x"))
    assert record["OS"] == "Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC @0"
    assert record["CfgTRES"] == "cpu=2,mem=2000M,billing=2" and record["AllocTRES"] == ""
    with pytest.raises(SlurmCommandError, match="no node record"):
        parse_node("Node node9 not found\n")


def test_topology_labels_from_the_switches_above_a_node() -> None:
    text = (
        "SwitchName=s1 Level=0 LinkSpeed=1 Nodes=node[1-2]\n"
        "SwitchName=top Level=1 LinkSpeed=1 Switches=s[1-2] Nodes=node[1-4]\n"
    )
    assert topology_labels(text) == {"rack": "s1", "zone": "top"}
    deep = text + "SwitchName=core Level=2 LinkSpeed=1 Switches=top Nodes=node[1-8]\n"
    assert topology_labels(deep)["switch-l2"] == "core"
    assert topology_labels("") == {}


def test_sbatch_job_ids() -> None:
    assert parse_job_id("42\n") == "42"
    assert parse_job_id("42;cluster\n") == "42"
    with pytest.raises(SlurmCommandError, match="no job id"):
        parse_job_id("sbatch: error: Batch job submission failed\n")


def test_validate_names_a_bad_slurm_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("print('hi')\n")
    Path("job.yaml").write_text(job("slurm:\n  signal_grace: 0\n"))
    done = CliRunner().invoke(main, ["validate", "job.yaml"])
    assert done.exit_code == 2
    assert "job.yaml:5: slurm.signal_grace: must be 1s to 65535s" in done.output
