"""An error of the training script's own is not a peer failure.

Every rank (or rank 0 only) raises ``RuntimeError("socket timed out ...")`` at step 5: words
that once looked like a network failure.  The workers record, then vote
(:mod:`agents.runtime.failures`): no collective failed and no newer generation is
published, so each reports a ``user_error`` break and exits with the error.
The controller restarts the job once (``max_restarts: 1``), the error comes
back, and the job fails with the script's message, without any recovery.
"""

from __future__ import annotations

import re
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from orchestrator.api import JobPhase
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.spec.loader import load_job_data
from orchestrator.state import keys
from tests.chaos.jobs import quiet_run, summary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MESSAGE = "socket timed out talking to my database"

SCRIPT = f'''
import os

import torch
import torch.nn.functional as F
from torch import nn

from agents import runtime

session = runtime.init()
model = session.wrap(nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session.track(model=model, optimizer=opt)
for step in session.steps():
    with session.guard():
        if step == 5 and str(session.rank) in os.environ["RAISE_ON_RANKS"].split(","):
            raise RuntimeError("{MESSAGE}")
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if session.step_failed:
        continue
session.close()
'''


@pytest.mark.parametrize(
    "ranks", [pytest.param("0,1", marks=pytest.mark.long), "0"], ids=["every-rank", "rank-0-only"]
)
def test_an_error_of_the_script_fails_the_job_without_recovery(
    tmp_path: Path, etcd: EmbeddedEtcd, ranks: str
) -> None:
    """With one rank raising, its peer's collective fails when it exits: the peer
    recovers into the controller's restart, and the error comes back there."""
    script = tmp_path / "train_user_error.py"
    script.write_text(textwrap.dedent(SCRIPT))
    spec = load_job_data(
        {
            "name": f"user-error-{ranks.replace(',', '-')}",
            "entrypoint": {"script": str(script), "env": {"RAISE_ON_RANKS": ranks}},
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "max_steps": 50,
            "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 0},
            "fault_tolerance": {"max_restarts": 1, "heartbeat_interval": "500ms"},
        }
    )
    lines: list[str] = []
    options = EtcdOptions((etcd.endpoint,))
    with quiet_run(spec, lines, etcd=options, timeout=timedelta(seconds=90)) as run:
        result = run.wait()
        recorded = run.client.get_prefix(keys.job_recoveries(spec.name))
    output = "\n".join(lines)
    assert result.phase is JobPhase.FAILED, summary(result, lines)
    assert result.wall_s < 60, summary(result, lines)
    assert MESSAGE in output, summary(result, lines)
    assert "RecoveryError" not in output, summary(result, lines)
    assert not re.search(r"\[rank\d+\]: \[rank\d+\]:", output), summary(result, lines)
    assert result.recoveries == 0, summary(result, lines)
    assert recorded == [], [kv.key for kv in recorded]
    failed = [e for e in result.events if e.type == "Phase" and "Failed" in e.message]
    assert failed and MESSAGE in failed[-1].message, failed


def _own_error_then_peer_leaves(rank: int, world_size: int) -> list[tuple[int, str | None]]:
    """Both ranks raise the script's own error at step 1; rank 1 leaves at step 3."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from agents.runtime.elastic_ddp import ElasticDDP
    from agents.runtime.failures import CollectiveFailures, peer_failure

    failures = CollectiveFailures()
    model = ElasticDDP(nn.Linear(4, 2), failures=failures)
    model.rebuild()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[tuple[int, str | None]] = []
    for step in range(5):
        if rank == 1 and step == 3:
            model.drop()  # its group goes when this returns: rank 0's all-reduce fails
            return seen
        failures.clear()
        try:
            if step == 1:
                raise RuntimeError(MESSAGE)
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
            opt.step()
        except RuntimeError as e:
            seen.append((step, peer_failure(e, failures.take(), None)))
            if step == 3:
                return seen
    return seen


def test_only_a_failed_collective_makes_a_peer_failure(gloo: Any) -> None:
    """The same type (RuntimeError) twice: the script's own, then a peer's departure."""
    survivor, leaver = gloo(_own_error_then_peer_leaves, 2, timeout=150)
    assert leaver == [(1, None)]
    assert survivor == [(1, None), (3, "a collective failed")]


def _peer_leaves_during_a_checkpoint_collective(rank: int, world_size: int) -> str | None:
    """Rank 1 leaves; rank 0's next checkpoint coordination (a save's agreement) fails."""
    from agents.runtime.failures import peer_failure
    from checkpoint.api import CheckpointPeerError
    from checkpoint.groups import Coordination

    coordination = Coordination()
    coordination.all_gather(rank, coordination.control)  # both ranks are there
    if rank == 1:
        return None  # its groups go with it: rank 0's next collective fails
    try:
        coordination.all_gather(rank, coordination.control)
    except CheckpointPeerError as e:
        return peer_failure(e, None, None)
    return "the collective did not fail"


def test_a_peer_gone_during_a_save_is_a_peer_failure(gloo: Any) -> None:
    """A save at the step boundary runs the checkpoint's own collectives, which no step
    records: their failure still says a peer is gone, not the script's own error (seen
    once under load: a node killed during a periodic save ended its survivor)."""
    survivor, leaver = gloo(_peer_leaves_during_a_checkpoint_collective, 2, timeout=150)
    assert leaver is None
    assert survivor == "a checkpoint collective failed"
