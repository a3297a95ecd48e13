"""The restart tier with node-local disks: the job fails at the start, not silently later.

Real processes: a private etcd, one ``ringmaster controller`` and three
``ringmaster agent`` processes, each agent started in a directory of its own
(as on machines with local disks).  The script is shaped like the PyTorch DDP
tutorial's: it keeps ``snapshot.pt`` in the directory it starts in (each
node's local rank 0 saves it) and loads it at start when it is there.

After a node's death the spare that takes its slot would find no snapshot and
train from zero, out of step with the survivor that resumed.  Each agent
registers where it sees the script's checkpoint; the controller sees three
places and fails the job before any worker starts, with a message that says
what to change.  ``submit`` has already said, in the job's events, that the
checkpoint is relative to where each agent starts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.api import JobPhase
from orchestrator.cli import main
from orchestrator.etcd.client import connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.state import events, jobs, keys, records
from orchestrator.state.records import Plan
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


def test_nodes_that_do_not_share_the_scripts_checkpoint_fail_at_start(
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
        for node in NODES:
            (tmp_path / node).mkdir()
            args = ["agent", "--job", job, "--node", node, "--labels", f"rack=r,host={node}"]
            services.start(node, [*args, "--etcd", etcd.endpoint], cwd=tmp_path / node)

        def registered() -> bool:
            return len(client.get_prefix(keys.job_nodes(job))) == len(NODES)

        # every agent registered before the controller decides: it sees all three places
        _wait("every agent to register", registered, lines)
        services.start("controller", ["controller", "--job", job, "--etcd", etcd.endpoint])

        def ended() -> bool:
            status = jobs.read_status(client, job)
            return status is not None and status.phase.terminal

        _wait("the job to end", ended, lines)
        status = jobs.read_status(client, job)
        plan = records.read(client, keys.job_plan(job), Plan)
        log = events.list_events(client, job)
    assert status is not None and status.phase is JobPhase.FAILED, status
    assert plan is None, plan  # no generation was published: no worker started
    assert list(logs.iterdir()) == []
    message = status.message
    assert message.startswith("the script's own checkpoint is not in one place every node "), (
        message
    )
    for node in NODES:
        assert f"{node} at " in message and str(tmp_path / node / "snapshot.tmp") in message
    assert "$RINGMASTER_CHECKPOINT_DIR" in message and "one directory on one machine" in message
    warnings = [e for e in log if e.type == "Warning"]
    assert len(warnings) == 1, [f"{e.type}: {e.message}" for e in log]
    assert warnings[0].source == "submit", warnings[0]
    assert warnings[0].message.startswith(
        "checkpoint: snapshot.tmp (torch.save in multinode.py line "
    ), warnings[0].message
