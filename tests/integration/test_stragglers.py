"""A real slow node: its workers stopped and continued by signals, told from its peers.

Real processes: ``LocalRun`` (embedded etcd, a controller, two node agents,
their workers on gloo).  The script's step is compute bound (it spins for a
set CPU time), as a training step is.  Once the job trains, one node's
workers get a duty cycle from outside, as a throttled machine would: stopped
(SIGSTOP) for 60 ms of every 100 ms, so they compute at 40 % speed.  The
controller must call that node, and only that node, a straggler (a
``Straggler`` event, the status's mark), then, once the duty cycle ends, say
it steps at its peers' pace again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator.api import JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.local_run import LocalRun
from orchestrator.spec.loader import load_job_data
from orchestrator.state import events, jobs, keys, records
from orchestrator.state.records import NodeRecord
from tests.faults.duty_cycle import DutyCycle

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = """\
import time
import torch
from torch import nn
from agents import runtime

session = runtime.init()
torch.manual_seed(0)
model = session.wrap(nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
session.track(model=model, optimizer=opt)
for step in session.steps():
    with session.guard():
        opt.zero_grad()
        end = time.process_time() + 0.02  # 20 ms of CPU, as a forward and backward would
        while time.process_time() < end:
            pass
        model(torch.randn(8, 16)).pow(2).sum().backward()
        opt.step()
session.close()
"""


def _wait_for(what: str, check, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def _stragglers(client: EtcdClient, job: str) -> dict[str, float]:
    status = jobs.read_status(client, job)
    return dict(status.stragglers) if status is not None else {}


def test_a_node_slowed_from_outside_is_called_a_straggler_and_cleared(tmp_path: Path) -> None:
    script = tmp_path / "spin.py"
    script.write_text(SCRIPT)
    spec = load_job_data(
        {
            "name": "stragglers",
            "entrypoint": str(script),
            "nodes": {"min": 2, "max": 2, "spares": 0},
            "fault_tolerance": {
                "heartbeat_interval": "1s",
                "stragglers": {"action": "report", "threshold": 1.3, "windows": 3},
            },
            "checkpoint": {"url": str(tmp_path / "ckpt"), "every_steps": 0},
        }
    )
    lines: list[str] = []
    run = LocalRun(spec, printer=lines.append, workdir=str(tmp_path), metrics_port=None)
    run.start()
    cycle: DutyCycle | None = None
    try:
        client = run.client

        def kinds() -> list[str]:
            return [e.type for e in events.list_events(client, spec.name)]

        def stepping() -> bool:
            status = jobs.read_status(client, spec.name)
            return status is not None and status.step >= 50

        _wait_for("the job to train", stepping, 120)
        node = records.read(client, keys.job_node(spec.name, "node-1"), NodeRecord)
        assert node is not None and node.worker_pids, node
        healthy = kinds()
        assert "Straggler" not in healthy, healthy  # no false call before the slowdown
        cycle = DutyCycle(node.worker_pids)
        cycle.start()
        _wait_for("a Straggler event", lambda: "Straggler" in kinds(), 60)
        # the status is written at the end of the tick that emitted the event (seen read
        # between the two once: the tick before's, without the straggler)
        _wait_for("the status of that tick", lambda: bool(_stragglers(client, spec.name)), 10)
        status = jobs.read_status(client, spec.name)
        assert status is not None and list(status.stragglers) == ["node-1"], status
        assert status.stragglers["node-1"] >= 1.3, status.stragglers
        cycle.done.set()
        cycle.join()
        _wait_for("a StragglerCleared event", lambda: "StragglerCleared" in kinds(), 60)
        jobs.request_stop(client, spec.name)
        result = run.wait()
    finally:
        if cycle is not None:
            cycle.done.set()
        run.stop()
    assert result.phase is JobPhase.STOPPED, "\n".join(lines[-40:])
    called = [e for e in result.events if e.type == "Straggler"]
    assert len(called) == 1 and called[0].data["node"] == "node-1", called
    assert called[0].message.startswith("node-1 computes "), called[0].message
    assert "reported only (fault_tolerance.stragglers.action: report)" in called[0].message
    cleared = [e for e in result.events if e.type == "StragglerCleared"]
    assert [e.data["node"] for e in cleared] == ["node-1"], cleared
