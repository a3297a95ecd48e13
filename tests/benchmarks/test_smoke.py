"""Every benchmark runs: ``benchmarks/<name>.py --smoke`` for each, found by its name.

A benchmark is a script that ``make bench`` runs for many minutes; nothing else
runs it, so a broken import or row would show only at its end.  Its smoke form
(``benchmarks/_smoke.py``: the smallest run through every row) runs here as
``make bench`` runs the benchmark, a process of its own from the repository
root.  It must exit 0 and end with one JSON object carrying ``"smoke": true``
(a smoke run's figures are never taken for measurements).  A benchmark that
cannot run here says so in that object (``"skipped": true`` and a ``reason``,
e.g. no network namespaces without root): the test is skipped with that reason.

Every ``benchmarks/[a-z]*.py`` is found by the glob ``make bench`` uses: a new
benchmark is run here without a change to this file.  Each run's wall time is
listed at the end of the session (``conftest.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.process_lifetime import signal_group
from tests.benchmarks.conftest import SMOKE_SECONDS

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted((REPO / "benchmarks").glob("[a-z]*.py"))
#: Seconds one smoke run may take (a generous bound: they take seconds to a few minutes).
TIMEOUT_S = float(os.environ.get("RINGMASTER_SMOKE_TIMEOUT", "420"))

pytestmark = [pytest.mark.bench_smoke, pytest.mark.timeout(TIMEOUT_S + 60)]


def test_the_benchmarks_are_found() -> None:
    names = [p.stem for p in BENCHMARKS]
    assert "recovery" in names and "checkpoint" in names, names


@pytest.mark.parametrize("script", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_smoke_run(script: Path, request: pytest.FixtureRequest) -> None:
    started = time.monotonic()
    # a session of its own: a run that overstays is stopped with everything it started
    proc = subprocess.Popen(
        [sys.executable, str(script.relative_to(REPO)), "--smoke"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out, err = _interrupt(proc)
        pytest.fail(
            f"{script.name} --smoke did not end within {TIMEOUT_S:g}s: a smoke run takes "
            f"seconds to minutes; make its --smoke form smaller, or raise "
            f"RINGMASTER_SMOKE_TIMEOUT.\nstdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}",
            pytrace=False,
        )
    finally:
        request.config.stash[SMOKE_SECONDS][script.stem] = time.monotonic() - started
    output = f"stdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}"
    assert proc.returncode == 0, f"{script.name} --smoke exited {proc.returncode}\n{output}"
    lines = stdout.strip().splitlines()
    assert lines, f"{script.name} --smoke printed nothing\n{output}"
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        pytest.fail(
            f"{script.name} --smoke: the last stdout line is not a JSON object ({e}); every "
            f"benchmark ends with one (benchmarks/_smoke.py).\n{output}",
            pytrace=False,
        )
    assert isinstance(result, dict), f"{script.name}: the last line is not an object\n{output}"
    assert result.get("smoke") is True, (
        f'{script.name} --smoke: its JSON line lacks "smoke": true, so its figures could be '
        f"taken for a real run; end it with benchmarks._smoke.result_line.\n{output}"
    )
    if result.get("skipped"):
        pytest.skip(f"{script.name} cannot run here: {result.get('reason', 'no reason given')}")


def _interrupt(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Stop a run that overstayed: Ctrl-C to its whole session first, so that its
    ``finally`` blocks remove what it made (network namespaces, servers) and the next
    benchmark starts on a clean machine; SIGKILL to whatever is left 30 s later.
    Returns its stdout and stderr."""
    signal_group(proc, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        out, err = proc.communicate()
    return out or "", err or ""
