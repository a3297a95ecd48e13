"""The straggler benchmark holds its slow node at the nominal factor, as measured.

``benchmarks/_straggler_slowdown.py`` adjusts what it applies to a node (the
stretch of each step) until the node's compute time per step over its peers'
median is the nominal factor.  Here a simulated node turns what is applied
into a measured factor the way shared cores do (only part of the stretch
shows: ``m - 1 = g (k - 1)`` with an unknown ``g``, plus each window's noise),
and :func:`next_applied` is run on its windows as :class:`HeldSlowdown` runs
it: the measured factor must come to the nominal one within a few windows and
stay there, whatever the gain, through noise and a change of load.
"""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks._straggler_slowdown import (
    CHANGE,
    RECENT,
    Window,
    measured_factor,
    next_applied,
)
from orchestrator.controller.stragglers import NodeTiming

pytestmark = pytest.mark.unit

#: a healthy node's compute per step (seconds) and the steps in a window
STEP_S, STEPS = 0.2, 6


def _window(measured: float, applied: float, at: float) -> Window:
    peers = {"a": NodeTiming(STEP_S, 0.1, STEPS), "b": NodeTiming(STEP_S, 0.1, STEPS)}
    return Window(at, measured, applied, NodeTiming(STEP_S * measured, 0.0, STEPS), peers)


def _hold(factor: float, gain: list[float], noise: float = 0.0, seed: int = 0) -> list[Window]:
    """Windows of a node held at ``factor``; ``gain[i]``: the share of the applied
    stretch that shows in window ``i`` (the machine's load)."""
    rng = random.Random(seed)
    applied, windows = factor, []
    for i, g in enumerate(gain):
        measured = (1.0 + g * (applied - 1.0)) * (1.0 + rng.uniform(-noise, noise))
        windows.append(_window(measured, applied, float(i)))
        applied = next_applied(windows[-RECENT:], factor, applied)
    return windows


@pytest.mark.parametrize("factor", [1.5, 3.0])
@pytest.mark.parametrize("gain", [0.35, 1.0, 2.0])
def test_the_measured_factor_comes_to_the_nominal_one(factor: float, gain: float) -> None:
    windows = _hold(factor, [gain] * 12)
    first = next(i for i, w in enumerate(windows) if abs(w.factor / factor - 1) < 0.02)
    assert first <= 6, [round(w.factor, 3) for w in windows]
    assert all(abs(w.factor / factor - 1) < 0.02 for w in windows[first:])


@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_noise_of_a_loaded_machine_leaves_the_factor_held_on_the_whole(factor: float) -> None:
    # +-25 % a window, as 2 s windows of a few steps read on 2 loaded cores
    held = [measured_factor(_hold(factor, [0.4] * 20, noise=0.25, seed=s)[4:]) for s in range(20)]
    assert all(m is not None for m in held)
    assert abs(statistics.median(m for m in held if m is not None) / factor - 1) < 0.05, held
    assert all(m is not None and abs(m / factor - 1) < 0.15 for m in held), held


def test_a_change_of_load_is_followed() -> None:
    windows = _hold(1.5, [1.0] * 8 + [0.4] * 10)
    assert abs(windows[7].factor / 1.5 - 1) < 0.02
    assert windows[8].factor < 1.3  # the load changed: less of the stretch shows
    assert abs(windows[-1].factor / 1.5 - 1) < 0.02


def test_one_window_moves_what_is_applied_by_a_bounded_step() -> None:
    applied = next_applied([_window(1.01, 1.5, 0.0)], 1.5, 1.5)  # hardly any effect seen
    assert applied == pytest.approx(1.0 + 0.5 * CHANGE)
    applied = next_applied([_window(4.0, 1.5, 0.0)], 1.5, 1.5)  # far too much
    assert applied == pytest.approx(1.0 + 0.5 / CHANGE)


def test_the_measured_factor_weighs_each_window_by_its_steps() -> None:
    a = _window(2.0, 2.0, 0.0)
    b = Window(1.0, 1.0, 2.0, NodeTiming(STEP_S, 0.0, 2 * STEPS), a.peers)
    assert measured_factor([a, b]) == pytest.approx((2.0 * STEPS + 2 * STEPS) / (3 * STEPS))
    assert measured_factor([]) is None
