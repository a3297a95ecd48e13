"""The step boundary's vote over real gloo ranks: every rank leaves it with the same
agreement, and with the same number of steps before the next vote (the fewest any
rank asked for)."""

from __future__ import annotations

from typing import Any

import pytest

from agents.runtime import boundary

pytestmark = pytest.mark.integration


def _vote(rank: int, world_size: int) -> dict[str, Any]:
    mine = boundary.Proposal(
        generation=3 + rank,  # rank 1 has seen a newer plan
        checkpoint_requested=3,
        checkpoint_served=rank,  # served 0, 1, 2 of the 3 requests: one is new
        stop=rank == 0,
        etcd_lost=False,
        save_due_by_time=False,
        every=[7, 2, 5][rank],
    )
    agreed = boundary.agree(mine)
    return {
        "generation": agreed.generation,
        "new_request": agreed.checkpoint_request_new,
        "stop": agreed.stop,
        "every": agreed.every,
    }


def test_every_rank_agrees_on_the_same_decisions_and_the_next_vote(gloo: Any) -> None:
    results = gloo(_vote, 3)
    assert results == [{"generation": 5, "new_request": True, "stop": True, "every": 2}] * 3


def test_votes_come_about_every_interval_of_training() -> None:
    interval = boundary.VOTE_INTERVAL_S
    assert boundary.steps_between_votes(interval * 2) == 1  # slow steps: vote at every one
    assert boundary.steps_between_votes(interval / 10) == 10
    assert boundary.steps_between_votes(1e-6) == boundary.MAX_STEPS_BETWEEN_VOTES
    assert boundary.steps_between_votes(0.0) == 1  # nothing measured yet
