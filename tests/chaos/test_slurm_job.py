"""A ringmaster job in a real Slurm allocation: a lost node, a drained node, a requeue.

One slurmctld and four ``slurmd -N nodeX`` on 127.0.0.1
(:mod:`tests.faults.slurm_cluster`) serve the module; each test submits a
tiny job (examples/train_tiny.py, two training nodes) with ``ringmaster slurm
submit`` and follows it through the batch script's output and the job's etcd.
The tests skip, with the reason, where Slurm is not installed
(``tests/slurm/install.sh`` installs it) or cannot start.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.chaos.jobs import assert_exactly_once, step_log, tiny_job
from tests.chaos.slurm_jobs import SlurmJob, submit
from tests.chaos.tiny_by_hand import tiny_final
from tests.faults.slurm_cluster import SlurmCluster, SlurmClusterError, slurm_skip_reason
from tests.integration.test_restart_tier import SCRIPT, TORCHRUN
from tests.integration.test_restart_tier import _args as restart_args
from tests.integration.test_restart_tier import _job as restart_job

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 150
#: Seconds per step: the job trains for several seconds after the fault.
STEP_TIME = 0.05


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    slurm = SlurmCluster(root, nodes=4, kill_wait=10)
    try:
        slurm.start()
    except SlurmClusterError as e:
        slurm.stop()
        pytest.skip(f"the Slurm daemons did not start here: {e}")
    try:
        yield slurm
    finally:
        slurm.stop()


@pytest.fixture
def fresh(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster with every node in service before and after the test, and no process
    of the test's jobs left after it."""
    yield cluster
    for name in cluster.names:
        cluster.revive(name)
        cluster.run("scontrol", "update", f"nodename={name}", "state=resume", check=False)
    cluster.wait_nodes("IDLE", cluster.names)


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7), f"{k} differs"


def assert_nothing_left(cluster: SlurmCluster, tmp: Path) -> None:
    """No process of the job on any node: Slurm's view (no step) and ps's agree."""
    assert cluster.run("squeue", "-h", "-s") == ""
    left = cluster.leftovers()
    assert left == [], cluster.describe(left)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert [line for line in ps.splitlines() if str(tmp) in line] == []


def _victim(job: SlurmJob, active: list[str]) -> str:
    """An active node that is not the batch host (which holds etcd and the controller)."""
    batch = job.batch_host()
    return next(n for n in active if n != batch)


def test_a_lost_node_is_swapped_for_a_spare_of_the_allocation(
    fresh: SlurmCluster, tmp_path: Path
) -> None:
    """2 training nodes + 1 spare; one node's machine dies mid-run (its slurmd, its step's
    slurmstepd and every process under it SIGKILLed): the agents' step and the
    allocation live on, the spare takes the slot, and the job ends with the parameters
    of a fault-free run."""
    spec = tiny_job("slurm-loss", tmp_path, steps=STEPS, step_time=STEP_TIME)
    job = submit(fresh, spec, tmp_path)
    status = job.wait_step(30)
    victim = _victim(job, status.active_nodes)
    fresh.kill_node(victim)
    fields = job.wait_end()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.tail()
    assert any(victim in m for m in job.events("NodeFailed")), job.tail()
    generations = job.events("Generation")
    assert len(generations) == 2 and "replaces" in generations[1], job.tail()
    assert "Succeeded: finished at step" in "\n".join(job.events("Phase")), job.tail()
    assert_exactly_once(tmp_path, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), tiny_final(STEPS))
    # Slurm, too, saw the node die; the allocation and the agents' step lived on without it
    fresh.wait_nodes("DOWN", [victim])
    assert_nothing_left(fresh, tmp_path)


def test_a_drained_node_leaves_as_on_a_preemption_with_no_step_lost(
    fresh: SlurmCluster, tmp_path: Path
) -> None:
    """``scontrol update state=drain`` on an active node: its agent sees the drain,
    the job saves, the node leaves and the spare takes its slot; no step is trained
    again and the parameters are a fault-free run's."""
    spec = tiny_job("slurm-drain", tmp_path, steps=STEPS, step_time=STEP_TIME)
    job = submit(fresh, spec, tmp_path)
    status = job.wait_step(30)
    victim = _victim(job, status.active_nodes)
    fresh.run("scontrol", "update", f"nodename={victim}", "state=drain", "reason=maintenance")
    fields = job.wait_end()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.tail()
    draining = job.events("NodeDraining")
    assert draining and victim in draining[0] and "maintenance" in draining[0], job.tail()
    assert any(f"preemption of {victim}" in m for m in job.events("Command")), job.tail()
    assert any("(requested)" in m for m in job.events("Checkpoint")), job.tail()
    assert not job.events("NodeFailed") or all(
        "preempt" in m or victim in m for m in job.events("NodeFailed")
    ), job.tail()
    generations = job.events("Generation")
    assert len(generations) == 2, job.tail()
    assert f"[{victim}] leaving: preempted; checkpoint committed" in job.text(), job.tail()
    assert_exactly_once(tmp_path, STEPS)
    # no step trained again: none applied by more workers than the job has ranks (a rank
    # stopped after its step's last collective but before its log line leaves one short)
    counts = collections.Counter(s for seq in step_log(tmp_path).values() for s in seq)
    assert max(counts.values()) == 2, [s for s, n in counts.items() if n > 2]
    assert_same_params(torch.load(tmp_path / "final.pt"), tiny_final(STEPS))
    assert "DRAIN" in fresh.node_states()[victim]
    assert_nothing_left(fresh, tmp_path)


def test_an_ended_allocation_saves_and_the_requeued_job_resumes_from_it(
    fresh: SlurmCluster, tmp_path: Path
) -> None:
    """The allocation is told it ends (SIGUSR1 to the batch script, as
    ``--signal=B:USR1@grace`` does before the time limit): the job writes a final
    checkpoint and the driver requeues the Slurm job; the next run (on whatever nodes
    it gets) resumes from that checkpoint and finishes with a fault-free run's
    parameters."""
    steps = 200  # the save comes soon after step 40: the second run trains the rest
    spec = tiny_job("slurm-requeue", tmp_path, steps=steps, step_time=STEP_TIME, spares=0)
    job = submit(fresh, spec, tmp_path, requeue=True)
    job.wait_step(40)
    fresh.run("scancel", "--batch", "--signal=USR1", job.job_id)
    saved = job.wait_line(r"\[event\] Checkpoint: step (\d+) committed .*\(stop")
    final_step = int(saved.group(1))
    job.wait_line(r"\[slurm\] requeueing job")
    job.close()
    fresh.wait_job(job.job_id, {"PENDING"}, timeout=60)
    fresh.release(job.job_id)  # Slurm holds a requeued job back for two minutes
    fields = job.wait_end(timeout=240)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.tail()
    assert fields["Restarts"] == "1", fields
    # the second run restored the final checkpoint: its workers' first step is the one after
    resumed = job.wait_line(r"resumed from \S+ at step (\d+)", timeout=1)
    assert int(resumed.group(1)) == final_step, job.tail()
    assert_exactly_once(tmp_path, steps)
    assert_same_params(torch.load(tmp_path / "final.pt"), tiny_final(steps))
    assert_nothing_left(fresh, tmp_path)


@pytest.mark.long
def test_a_node_slurm_marks_down_is_swapped_for_the_spare(
    fresh: SlurmCluster, tmp_path: Path
) -> None:
    """``scontrol update state=down`` on an active node: Slurm signals the node's tasks
    and takes the node out of the allocation; the spare takes its slot and the job
    ends with a fault-free run's parameters."""
    spec = tiny_job("slurm-down", tmp_path, steps=STEPS, step_time=STEP_TIME)
    job = submit(fresh, spec, tmp_path)
    status = job.wait_step(30)
    victim = _victim(job, status.active_nodes)
    fresh.run("scontrol", "update", f"nodename={victim}", "state=down", "reason=taken")
    fields = job.wait_end()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.tail()
    generations = job.events("Generation")
    assert len(generations) == 2 and victim not in generations[1].split("(")[0], job.tail()
    assert_exactly_once(tmp_path, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), tiny_final(STEPS))
    assert_nothing_left(fresh, tmp_path)


@pytest.mark.long
@pytest.mark.timeout(900)
def test_a_time_limited_allocation_saves_before_its_end_and_the_job_resumes(
    fresh: SlurmCluster, tmp_path: Path
) -> None:
    """``slurm.time`` 2 minutes, ``signal_grace`` 60 s: Slurm signals the batch script
    before the limit, the job saves and is requeued, and each run resumes from the
    previous one's final checkpoint until the job is done."""
    steps = 1200
    spec = tiny_job("slurm-time", tmp_path, steps=steps, step_time=STEP_TIME, spares=0)
    job = submit(fresh, spec, tmp_path, time="2", signal_grace=60, requeue=True)
    ended = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"}
    for _ in range(5):  # each run: start, train, save before the limit, requeue
        if fresh.wait_job(job.job_id, {"PENDING", *ended}, 300)["JobState"] in ended:
            break
        fresh.release(job.job_id)  # submitted, or requeued and held back for two minutes
        fresh.wait_job(job.job_id, {"RUNNING", *ended}, 60)
    fields = job.wait_end(timeout=300)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.tail()
    assert int(fields["Restarts"]) >= 1, fields
    saved = [int(m) for m in re.findall(r"Checkpoint: step (\d+) committed .*\(stop\)", job.text())]
    resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", job.text())]
    assert saved and sorted(set(resumed)) == saved, (saved, resumed)
    assert_exactly_once(tmp_path, steps)
    assert_same_params(torch.load(tmp_path / "final.pt"), tiny_final(steps))
    assert_nothing_left(fresh, tmp_path)


@pytest.mark.long
def test_the_restart_tier_swaps_a_lost_node_the_same_way(
    fresh: SlurmCluster, tmp_path: Path, torchrun_params: dict[str, torch.Tensor]
) -> None:
    """An unmodified torchrun script (examples/train_torchrun.py, its own checkpoints
    every 8 steps) in the allocation: a node's machine dies, the spare takes its slot,
    every worker starts again and the script resumes from its own checkpoint, ending
    with the parameters of the fault-free torchrun run."""
    spec = restart_job("slurm-restart", tmp_path)
    job = submit(fresh, spec, tmp_path)
    job.wait_line(r"\[event\] Phase: Running")
    _wait_rank0_step(job, tmp_path / "steps" / "rank-0.log", 20)
    status = job.status()
    assert status is not None, job.tail()
    victim = _victim(job, status.active_nodes)
    fresh.kill_node(victim)
    fields = job.wait_end()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", job.tail()
    assert any(victim in m for m in job.events("NodeFailed")), job.tail()
    generations = job.events("Generation")
    assert len(generations) == 2 and "replaces" in generations[1], job.tail()
    final = torch.load(tmp_path / "final.pt")
    for k, v in torchrun_params.items():
        assert torch.equal(final[k], v), f"{k} differs from the fault-free torchrun run"
    assert_nothing_left(fresh, tmp_path)


def _wait_rank0_step(job: SlurmJob, log: Path, step: int, timeout: float = 120) -> None:
    """Wait until the script's rank 0 logged ``step`` (a checkpoint lies behind it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if lines and int(lines[-1].split()[0]) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"rank 0 did not reach step {step}:\n{job.tail()}")


@pytest.fixture(scope="module")
def torchrun_params(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """examples/train_torchrun.py under stock torchrun, no failure: the reference."""
    tmp = tmp_path_factory.mktemp("torchrun")
    (tmp / "steps").mkdir()
    args = [*restart_args(tmp, tmp / "final.pt"), "--checkpoint-dir", str(tmp / "ckpt")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")}
    done = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node=2", str(SCRIPT), *args],
        cwd=tmp,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(tmp / "final.pt")  # type: ignore[no-any-return]
