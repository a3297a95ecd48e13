"""One benchmark run as ``make bench`` runs it: a process of its own from the
repository root, whose last line of output is its JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(name: str, args: list[str], timeout: float) -> tuple[dict[str, Any], str]:
    """Run ``benchmarks/<name>.py`` with ``args``: its JSON object, and the tail of its
    output for failure messages.  Fails the test when it exits other than 0."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, output
    return json.loads(done.stdout.strip().splitlines()[-1]), output
