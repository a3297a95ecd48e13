"""The straggler benchmark's job: a compute-bound step, every applied step logged.

Shared by ``benchmarks/stragglers.py`` and its slow-link row
(``benchmarks/_slow_link_row.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.spec import JobSpec, StragglerAction
from orchestrator.spec_loader import load_job_data

#: The training script: a compute-bound step, every applied step logged with its time.
SCRIPT = """\
import os, sys, time
import torch
from torch import nn
from agents import runtime

compute, log_dir = float(sys.argv[1]), sys.argv[2]
width = int(sys.argv[3]) if len(sys.argv) > 3 else 32
session = runtime.init()
torch.manual_seed(0)
model = session.wrap(nn.Linear(width, 8 if width == 32 else width))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
session.track(model=model, optimizer=opt)
log = None
for step in session.steps():
    with session.guard():
        opt.zero_grad()
        end = time.process_time() + compute
        while time.process_time() < end:
            pass
        model(torch.randn(16, width)).pow(2).sum().backward()
        opt.step()
    if session.step_failed:
        continue
    if log is None:
        log = open(os.path.join(log_dir, f"{session.worker}-{os.getpid()}.log"), "a")
    log.write(f"{step} {time.time()}\\n")
    log.flush()
session.close()
"""


def job(name: str, tmp: Path, args: argparse.Namespace, *, nodes: int, spares: int,
        action: StragglerAction, steps: int, width: int = 32) -> JobSpec:  # fmt: skip
    (tmp / "steps").mkdir(parents=True, exist_ok=True)
    script = tmp / "spin.py"
    script.write_text(SCRIPT)
    spec = load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(script),
                "args": [str(args.compute), str(tmp / "steps"), str(width)],
            },
            "nodes": {"min": nodes, "max": nodes, "spares": spares},
            "max_steps": steps,
            "fault_tolerance": {
                "heartbeat_interval": args.heartbeat,
                "stragglers": {"action": action.value, "min_gain": "0s"},
            },
            "checkpoint": {"url": str(tmp / "ckpt"), "every_steps": 0},
        }
    )
    return spec


def step_times(tmp: Path) -> tuple[dict[int, float], int]:
    """Each step's completion time (the first worker to log it), and the steps applied
    twice by one worker or never by any (of those up to the highest seen)."""
    done: dict[int, float] = {}
    lost = 0
    for f in (tmp / "steps").glob("*.log"):
        seen: set[int] = set()
        for line in f.read_text().splitlines():
            step, at = line.split()
            s = int(step)
            lost += s in seen
            seen.add(s)
            done[s] = min(done.get(s, float("inf")), float(at))
    if done:
        lost += sum(1 for s in range(max(done) + 1) if s not in done)
    return done, lost


def rate(done: dict[int, float], start: float, end: float) -> float | None:
    """Steps per second completed between ``start`` and ``end`` (wall clock)."""
    inside = [t for t in done.values() if start <= t <= end]
    return len(inside) / (end - start) if end > start and len(inside) > 1 else None
