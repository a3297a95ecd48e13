"""The straggler benchmark's jobs, every applied step logged.

* :func:`lm_job`: the flagship LM (``examples/train_lm.py``, DDP) or its sharded
  form (``examples/train_lm_mesh.py --mesh shard=2``: FSDP2 within a node,
  replicas across nodes), run through ``benchmarks/_noisy_worker.py`` (the step
  log, the GC pause storm), with the straggler settings of a :class:`Settings`;
* :func:`job`: a compute-bound busy step around a small layer, for the extra
  rows (overhead, slow link).

Shared by ``benchmarks/stragglers.py`` and its slow-link row
(``benchmarks/_slow_link_row.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.spec.job import JobSpec, StragglerAction
from orchestrator.spec.loader import load_job_data

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "_noisy_worker.py"


@dataclass(frozen=True)
class Settings:
    """``fault_tolerance`` keys a row sets; every other key keeps the job file's default."""

    name: str
    #: ``fault_tolerance.stragglers`` keys beyond ``action``
    stragglers: dict[str, Any] = field(default_factory=dict)
    #: ``fault_tolerance.heartbeat_interval`` (one window); None: the default
    heartbeat: str | None = None

    def describe(self, action: StragglerAction) -> str:
        """What the row ran with, for its output."""
        from orchestrator.spec.job import FaultToleranceSpec

        ft = FaultToleranceSpec()
        s = ft.stragglers
        given = {"action": action.value, **self.stragglers}
        every = {
            "action": s.action.value,
            "threshold": s.threshold,
            "windows": s.windows,
            "min_gain": f"{s.min_gain.total_seconds():g}s",
            "confirm": f"{s.confirm.total_seconds():g}s",
        }
        every.update(given)
        beat = self.heartbeat or f"{ft.heartbeat_interval.total_seconds():g}s"
        text = ", ".join(
            f"{k} {v}" + ("" if k in given else " (default)") for k, v in every.items()
        )
        return f"{self.name}: stragglers {text}; heartbeat_interval {beat}" + (
            "" if self.heartbeat else " (default)"
        )


#: the job file's defaults; ``action: swap`` is set by the rows that swap (the
#: default action is ``report``)
DEFAULTS = Settings("defaults")
#: the benchmark's former settings: 1 s windows, 3 of them, every swap made
FAST = Settings("fast-settings", {"windows": 3, "min_gain": "0s"}, "1s")
#: ``--smoke``: half-second windows, 2 of them, no wait: the code path, not a figure
SMOKE = Settings("smoke-settings", {"windows": 2, "min_gain": "0s", "confirm": "0s"}, "500ms")


def lm_job(
    name: str,
    tmp: Path,
    *,
    sharded: bool,
    settings: Settings,
    action: StragglerAction,
    steps: int,
    short: bool = False,
    gc_storm: Path | None = None,
    slow: Path | None = None,
    nodes: int = 0,
    spares: int = 1,
) -> JobSpec:
    """The LM under DDP (``nodes`` active nodes of 1 worker, 3 unless given) or sharded
    (2 of 2 workers, HSDP: FSDP2 within a node), ``spares`` warm spares, its steps
    logged in ``tmp/steps``."""
    (tmp / "steps").mkdir(parents=True, exist_ok=True)
    wrapper = ["--step-log", str(tmp / "steps")]
    if gc_storm is not None:
        wrapper += ["--gc-storm", str(gc_storm)]
    if slow is not None:
        wrapper += ["--slow", str(slow)]
    if sharded:
        example = [str(REPO / "examples" / "train_lm_mesh.py"), "--mesh", "shard=2"]
        nodes, nproc = nodes or 2, 2
    else:
        example = [str(REPO / "examples" / "train_lm.py"), "--accum", "2"]
        nodes, nproc = nodes or 3, 1
    example += ["--warmup", "20", "--log-every", "1000000"] + (["--short"] if short else [])
    ft: dict[str, Any] = {"stragglers": {"action": action.value, **settings.stragglers}}
    if settings.heartbeat:
        ft["heartbeat_interval"] = settings.heartbeat
    return load_job_data(
        {
            "name": name,
            "entrypoint": {"script": str(WORKER), "args": wrapper + example},
            "nodes": {"min": nodes, "max": nodes, "spares": spares},
            "nproc_per_node": nproc,
            "max_steps": steps,
            "checkpoint": {"url": str(tmp / "ckpt"), "every_steps": 0},
            "fault_tolerance": ft,
        }
    )


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


def job(
    name: str,
    tmp: Path,
    args: argparse.Namespace,
    *,
    nodes: int,
    spares: int,
    action: StragglerAction,
    steps: int,
    width: int = 32,
) -> JobSpec:
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
