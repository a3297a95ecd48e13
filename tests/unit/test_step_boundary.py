"""What a step boundary decides from the ranks' agreement (no process group needed)."""

from __future__ import annotations

import pytest

from agents.runtime.boundary import Agreement, StepBoundary
from checkpoint.triggers import SaveTrigger
from orchestrator.state.records import ControlRecord

pytestmark = pytest.mark.unit


def _served(b: StepBoundary) -> int:
    mine = b.propose(
        generation=1, control=ControlRecord(), etcd_lost=False, time_due=False, step_seconds=1.0
    )
    return mine.checkpoint_served


def test_a_boundary_acts_on_the_agreement_and_schedules_the_next_vote() -> None:
    b, every_5 = StepBoundary(), SaveTrigger(every_steps=5)
    assert b.votes_at(1)
    agreed = Agreement(
        generation=2,
        checkpoint_requested=3,
        checkpoint_served=2,
        stop=True,
        etcd_lost=False,
        save_due_by_time=False,
        every=4,
    )
    d = b.decide(5, 1, agreed, every_5)
    assert d.saves == ("requested", "stop"), "a request wins over the periodic save"
    assert (d.generation, d.stop, d.pause, d.served) == (2, True, False, 3)
    assert not b.votes_at(8) and b.votes_at(9)
    assert _served(b) == 0, "requests count as served once their saves are made"
    b.served(d)
    assert _served(b) == 3
    quiet = b.decide(10, 2, None, every_5)  # no vote: steps alone decide
    assert quiet.saves == ("periodic",) and not quiet.stop and quiet.generation == 2
    assert b.decide(11, 2, None, every_5).saves == ()
    b.joined()
    assert b.votes_at(0), "a generation's first boundary votes"


def test_time_is_due_when_it_is_due_on_some_rank() -> None:
    b = StepBoundary()
    agreed = Agreement(1, 0, 0, False, False, save_due_by_time=True)
    assert b.decide(3, 1, agreed, SaveTrigger(every_seconds=60)).saves == ("periodic",)


def test_gloo_losing_a_peer_is_a_peer_failure_wherever_it_was_raised() -> None:
    """gloo's transport text means a peer's socket went, also from a collective that no
    step recorded, and also under an error raised from it (a storage error wrapping it)."""
    from agents.runtime.failures import peer_failure

    lost = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:19097: Connection reset by peer."
    )
    assert peer_failure(lost, None, None) == "gloo lost the connection to a peer"
    try:
        try:
            raise lost
        except RuntimeError as e:
            raise OSError("upload failed") from e
    except OSError as wrapped:
        assert peer_failure(wrapped, None, None) == "gloo lost the connection to a peer"
    assert peer_failure(RuntimeError("socket timed out talking to my database"), None, None) is None


def test_a_sites_vote_leaves_saves_and_stops_to_the_rounds_agreement() -> None:
    """Under a delayed sync each site votes inside itself: its vote moves it to a newer
    generation and pauses it, but a save or a stop happens only where the sites agreed
    on it in an outer sync's round (at the same step on every site)."""
    b, never = StepBoundary(), SaveTrigger()
    b.sites = True
    site = Agreement(3, 5, 0, True, True, True, save_unsettled=False)
    alone = b.decide(10, 2, site, never)
    assert alone.saves == () and not alone.stop and not alone.settle
    assert alone.generation == 3 and alone.pause and alone.served == 0
    across = Agreement(2, 5, 0, True, False, False, save_unsettled=False)
    both = b.decide(11, 2, site, never, across=across)
    assert both.saves == ("requested", "stop") and both.stop and both.settle
    assert both.generation == 3 and both.pause and both.served == 5
    assert Agreement.of_vector(across.vector()) == across


def test_a_saves_outcome_is_taken_only_where_every_ranks_save_has_ended() -> None:
    """Each rank counts a failed asynchronous save when every rank's has ended, at the
    same boundary: a rank that counted first could fail the job for it before rank 0,
    which reports the failures, had seen it."""
    b, never = StepBoundary(), SaveTrigger()
    one_uploads = Agreement(1, 0, 0, False, False, False, save_unsettled=True)
    assert not b.decide(3, 1, one_uploads, never).settle
    all_ended = Agreement(1, 0, 0, False, False, False, save_unsettled=False)
    assert b.decide(4, 1, all_ended, never).settle
    assert not b.decide(5, 1, None, never).settle, "no vote: no rank knows of the others"
    mine = b.propose(
        generation=1,
        control=ControlRecord(),
        etcd_lost=False,
        time_due=False,
        step_seconds=1.0,
        save_unsettled=True,
    )
    assert mine.save_unsettled
