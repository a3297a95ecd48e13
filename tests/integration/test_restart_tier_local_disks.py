"""The restart tier with node-local disks: a spare must not silently reset the job.

Real processes: a private etcd, one ``ringmaster controller`` and three
``ringmaster agent`` processes, each agent started in a directory of its own
(as on machines with local disks).  The script is shaped like the PyTorch DDP
tutorial's: it keeps ``snapshot.pt`` in the directory it starts in (each
node's local rank 0 saves it), loads it at start when it is there, and wraps
its model in DDP, which broadcasts rank 0's parameters at construction.

When the rank-0 node dies, the spare that takes its slot finds no snapshot.
As rank 0 it would broadcast its fresh weights over what the survivor
restored; rank 0 must stay on the survivor.  ``submit`` says, in the job's
events, that the checkpoint is relative to where each agent starts.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import events, jobs, keys, records
from orchestrator.cli import main
from orchestrator.etcd.client import connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.records import Plan
from tests.faults.processes import Services

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

NODES = ("node-a", "node-b", "node-c")

#: The tutorial's checkpointing, cut down: snapshot.pt beside where it starts.
SCRIPT = """\
import os, sys, time
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

log_dir = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Linear(8, 4)
epochs_run = 0
if os.path.exists("snapshot.pt"):
    snapshot = torch.load("snapshot.pt")
    model.load_state_dict(snapshot["MODEL_STATE"])
    epochs_run = snapshot["EPOCHS_RUN"]
ddp = DDP(model)
total = float(sum(p.double().sum() for p in model.parameters()))
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(log_dir, f"gen{restart}-rank{rank}.txt"), "w") as f:
    f.write(f"{epochs_run} {total!r} {os.getcwd()}\\n")
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
data = torch.Generator().manual_seed(rank)
for epoch in range(epochs_run, 100_000):
    loss = ddp(torch.randn(4, 8, generator=data)).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if os.environ["LOCAL_RANK"] == "0":
        state = {"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(state, "snapshot.tmp")
        os.replace("snapshot.tmp", "snapshot.pt")
    time.sleep(0.05)
"""


def _wait(what: str, check: Callable[[], bool], lines: list[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    tail = "\n".join(lines[-60:])
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{tail}")


def _read(path: Path) -> tuple[int, float, str]:
    epochs, total, cwd = path.read_text().split()
    return int(epochs), float(total), cwd


def test_a_spare_without_the_snapshot_never_becomes_rank_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = f"local-disks-{uuid.uuid4().hex[:6]}"
    logs = tmp_path / "logs"
    logs.mkdir()
    script = tmp_path / "multinode.py"
    script.write_text(SCRIPT)
    submit_dir = tmp_path / "submit"
    submit_dir.mkdir()
    (submit_dir / "job.yaml").write_text(
        f"name: {job}\nentrypoint: {{script: {script}, args: ['{logs}']}}\n"
        "nodes: {min: 2, max: 2, spares: 1}\nfault_tolerance: {max_restarts: 0}\n"
    )
    lines: list[str] = []
    with (
        EmbeddedEtcd() as etcd,
        Services(lines) as services,
        connect(EtcdOptions((etcd.endpoint,))) as client,
    ):
        monkeypatch.chdir(submit_dir)
        submitted = CliRunner().invoke(main, ["submit", "job.yaml", "--etcd", etcd.endpoint])
        assert submitted.exit_code == 0, submitted.output
        services.start("controller", ["controller", "--job", job, "--etcd", etcd.endpoint])
        for node in NODES:
            (tmp_path / node).mkdir()
            args = ["agent", "--job", job, "--node", node, "--labels", f"rack=r,host={node}"]
            services.start(node, [*args, "--etcd", etcd.endpoint], cwd=tmp_path / node)

        def first_plan() -> Plan | None:
            return records.read(client, keys.job_plan(job), Plan)

        _wait("generation 1 to train", lambda: len(list(logs.glob("gen0-*"))) == 2, lines)
        plan = first_plan()
        assert plan is not None and plan.generation == 1
        victim, survivor = plan.members[0].node, plan.members[1].node
        snapshot = tmp_path / victim / "snapshot.pt"
        _wait("a few epochs in the victim's snapshot", snapshot.exists, lines)
        _wait("the survivor's own snapshot", (tmp_path / survivor / "snapshot.pt").exists, lines)
        time.sleep(0.3)  # a few more epochs: the restored weights differ from fresh ones
        services.signal(victim, signal.SIGKILL)  # the agent and its workers
        _wait("generation 2 to start its workers", lambda: len(list(logs.glob("gen1-*"))) == 2,
              lines)  # fmt: skip
        replaced = records.read(client, keys.job_plan(job), Plan)
        assert replaced is not None and replaced.generation == 2, replaced
        fresh = _read(logs / "gen0-rank0.txt")[1]
        rank0, rank1 = _read(logs / "gen1-rank0.txt"), _read(logs / "gen1-rank1.txt")
        text = "\n".join(lines[-40:])
        # rank 0 is the survivor, which restored its snapshot; DDP gave the spare its weights
        assert replaced.members[0].node == survivor, f"{replaced}\n{text}"
        assert rank0[2] == str(tmp_path / survivor) and rank0[0] > 0, rank0
        assert rank1[2] != str(tmp_path / survivor) and rank1[0] == 0, rank1
        assert rank0[1] == rank1[1] != fresh, (rank0, rank1, fresh)
        log = events.list_events(client, job)
        jobs.request_stop(client, job)
    warnings = [e for e in log if e.type == "Warning"]
    assert len(warnings) == 1, [f"{e.type}: {e.message}" for e in log]
    message = warnings[0].message
    assert warnings[0].source == "submit", warnings[0]
    assert message.startswith("checkpoint: snapshot.tmp (torch.save in multinode.py line "), message
    assert (
        "a path relative to the directory each agent starts in; a node whose agent starts in "
        "another directory or on another machine finds no checkpoint there"
    ) in message
