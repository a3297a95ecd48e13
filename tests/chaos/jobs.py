"""Job specs and run helpers shared by the chaos tests."""

from __future__ import annotations

import collections
import itertools
import sys
import time
from pathlib import Path

from checkpoint.commit import parse_step_dir
from orchestrator.api import JobPhase
from orchestrator.local_run import LocalRun, RunResult
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs

REPO = Path(__file__).resolve().parents[2]


def tiny_job(
    name: str,
    tmp: Path,
    steps: int = 120,
    step_time: float = 0.03,
    spares: int = 1,
    hang_timeout: str = "30s",
    extra_args: list[str] | None = None,
    comm: dict[str, object] | None = None,
    script: Path | None = None,
    env: dict[str, str] | None = None,
) -> JobSpec:
    """2 active nodes + ``spares`` spares running examples/train_tiny.py (or ``script``,
    which takes its arguments, with ``env`` added to the workers' environment)."""
    (tmp / "steps").mkdir(exist_ok=True)
    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(script or REPO / "examples" / "train_tiny.py"),
                "args": [
                    "--step-time",
                    str(step_time),
                    "--out",
                    str(tmp / "final.pt"),
                    "--step-log",
                    str(tmp / "steps"),
                    *(extra_args or []),
                ],
                "env": {"RINGMASTER_LOG_EVERY": "1000", **(env or {})},
            },
            "nodes": {"min": 2, "max": 2, "spares": spares},
            "max_steps": steps,
            "checkpoint": {"url": f"file://{tmp}/ckpt", "every_steps": 0},
            "comm": comm or {},
            "fault_tolerance": {
                "hang_timeout": hang_timeout,
                "heartbeat_interval": "500ms",
                "preemption_grace": "20s",
            },
        }
    )


def quiet_run(spec: JobSpec, lines: list[str], **kwargs: object) -> LocalRun:
    """A local run whose output goes to ``lines`` (and to pytest's captured stdout,
    shown when a test fails, also on a timeout).

    The lines go to the process's own standard output (``sys.__stdout__``, which
    pytest captures at the descriptor), not to whatever ``sys.stdout`` is at the
    time: a line the run prints late, while a test runs a CLI command through
    click's ``CliRunner`` (which swaps ``sys.stdout``), would otherwise land in that
    command's output (seen once: a worker's last line inside ``events --json``)."""
    out = sys.__stdout__ or sys.stdout

    def keep(line: str) -> None:
        lines.append(line)
        print(line, file=out, flush=True)

    return LocalRun(spec, printer=keep, workdir=str(REPO), **kwargs)  # type: ignore[arg-type]


def wait_for_step(run: LocalRun, step: int, timeout: float = 90) -> None:
    """Wait until the job runs at ``step`` or later (its status, as the controller wrote it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = jobs.read_status(run.client, run.spec.name)
        if status and status.step >= step and status.phase is JobPhase.RUNNING:
            return
        time.sleep(0.1)
    raise AssertionError(f"job did not reach step {step} in {timeout}s")


def step_log(tmp: Path) -> dict[str, list[int]]:
    """Steps applied by each worker process, in order."""
    out = {}
    for f in sorted((tmp / "steps").glob("*.log")):
        out[f.stem] = [int(line.split()[0]) for line in f.read_text().splitlines()]
    return out


def assert_exactly_once(tmp: Path, steps: int) -> None:
    """No worker applied a step twice, and every step was applied by someone.

    A worker applies steps again only when its state was dropped and then came from a
    durable checkpoint (fenced out while it held state, then back with nothing live
    left to take state from): it then starts, in a later generation, at that checkpoint's
    step, the first the checkpoint does not hold (``examples/train_tiny.py`` logs the
    checkpoint it last resumed from).
    """
    records = _step_records(tmp)
    assert records, "no step logs written"
    for worker, seq in records.items():
        for (step0, gen0, _), (step, gen, resumed) in itertools.pairwise(seq):
            if step > step0:
                continue
            after = parse_step_dir(resumed.rstrip("/").rsplit("/", 1)[-1])
            assert gen > gen0 and after is not None and step == after, (
                f"{worker} applied step {step} twice or out of order (generation {gen0} "
                f"to {gen}, its state last resumed from {resumed}): {[r[0] for r in seq]}"
            )
    counts = collections.Counter(s for seq in records.values() for s in {r[0] for r in seq})
    missing = [s for s in range(steps) if counts[s] == 0]
    assert not missing, f"steps never applied: {missing}"


def _step_records(tmp: Path) -> dict[str, list[tuple[int, int, str]]]:
    """Each worker's (step, generation, checkpoint last resumed from or '-'), in order."""
    out = {}
    for f in sorted((tmp / "steps").glob("*.log")):
        fields = [line.split() for line in f.read_text().splitlines()]
        out[f.stem] = [(int(v[0]), int(v[1]), v[4] if len(v) > 4 else "-") for v in fields]
    return out


def summary(result: RunResult, lines: list[str]) -> str:
    tail = "\n".join(lines[-60:])
    return f"phase={result.phase.value} step={result.step} recoveries={result.recoveries}\n{tail}"
