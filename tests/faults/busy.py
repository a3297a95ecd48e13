"""A rank slowed from inside: CPU spent in its own step, as a slow device or a
throttled host would make it (the timing tests compare ranks, not clocks)."""

from __future__ import annotations

import time

__all__ = ["spin"]


def spin(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` (a sleep would give the core away)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
