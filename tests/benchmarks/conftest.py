"""The benchmarks' smoke runs: their wall times at the end of a run."""

from __future__ import annotations

from typing import Any

import pytest

#: Seconds each benchmark's smoke run took, by benchmark, filled by ``test_smoke.py``.
SMOKE_SECONDS = pytest.StashKey[dict[str, float]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[SMOKE_SECONDS] = {}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Each smoke run's wall time, the longest first: what the smoke forms cost."""
    seconds = terminalreporter.config.stash.get(SMOKE_SECONDS, {})
    if not seconds:
        return
    terminalreporter.section(f"benchmark smoke runs: {sum(seconds.values()):.0f} s in all")
    for name, s in sorted(seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{s:8.1f} s  benchmarks/{name}.py --smoke")
