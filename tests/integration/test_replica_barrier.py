"""A replica's ranks apply an optimizer step together, or none of them does.

Two real gloo processes form a replica group and attach the barrier to an SGD
optimizer.  A step both take goes through; when one rank leaves its step before
the optimizer (as a rank whose collective failed does), the other's
``optimizer.step()`` raises and leaves its parameters as they were, so the
survivors of a node loss hold slices of one step.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.replica_barrier_workers import step_then_leave

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_rank_does_not_step_when_its_replica_peer_left_the_step(gloo: Any) -> None:
    stayed, left = gloo(step_then_leave, 2)
    assert left == {"left": True}
    assert stayed["changed_0"], stayed  # the step both took went through
    assert "error" in stayed and not stayed["changed_1"], stayed  # alone: refused, untouched
    assert stayed["met"] == 1, stayed  # one hook only, though attached twice
