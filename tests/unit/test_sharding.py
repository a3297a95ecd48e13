"""Where slices come from: the pure planning of :mod:`agents.recovery.shard_transfer`, and the
checks of :mod:`agents.state.sharding` (modes, layouts, a scalar parameter)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agents.recovery.shard_transfer import pieces, plan
from agents.state.sharding import (
    Layout,
    ShardedModel,
    check_hsdp_world,
    check_mode,
    chunk_rows,
    layout_of,
    redundancy_ignored,
)

pytestmark = pytest.mark.unit


def test_chunk_rows_match_torch_chunk() -> None:
    for rows in (0, 1, 5, 7, 32):
        for shards in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(shards) if rows else ()
            for index in range(shards):
                start, stop = chunk_rows(rows, Layout(shards, index))
                want = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(start, stop)) == want, (rows, shards, index)


def test_layouts_of_the_two_modes() -> None:
    assert [layout_of("fsdp", r, 3, 1) for r in range(3)] == [Layout(3, i) for i in range(3)]
    assert [layout_of("hsdp", r, 4, 2).index for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="multiple of the shard group size: 3 ranks"):
        check_hsdp_world(3, 2)


def test_bad_settings_say_what_is_valid() -> None:
    with pytest.raises(ValueError, match="'zero3' is not a sharding mode; use one of 'ddp'"):
        check_mode("zero3")
    with pytest.raises(ValueError, match="shard_size must be at least 1"):
        ShardedModel(nn.Linear(2, 2), "hsdp", shard_size=0)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.0))

    with pytest.raises(ValueError, match="parameter scale is a scalar"):
        ShardedModel(Scaled(), "fsdp")


def test_a_twin_serves_the_replaced_rank_and_the_others_keep_theirs() -> None:
    # hsdp 2 x 2: ranks 2 and 3 (a node) were replaced; ranks 0 and 1 hold step 9
    held = [[(9, 2, 0, True)], [(9, 2, 1, True)], [], []]
    new = [Layout(2, i % 2) for i in range(4)]
    tp = plan(held, new)
    assert tp is not None and tp.step == 9 and tp.old == 2
    assert tp.holder[(0, 0)] == 0 and tp.holder[(1, 1)] == 1
    assert tp.holder[(2, 0)] == 0 and tp.holder[(3, 1)] == 1


def test_the_newest_complete_step_wins_over_a_newer_partial_one() -> None:
    # rank 0 is live at 8 and kept a snapshot of 7; rank 1 holds the dead rank's copy of 7
    held = [[(8, 2, 0, True), (7, 2, 0, True)], [(7, 2, 1, False)]]
    tp = plan(held, [Layout(2, 0), Layout(2, 1)])
    assert tp is not None and tp.step == 7 and tp.replicated_from == 0


def test_nothing_complete_means_no_plan() -> None:
    assert plan([[(5, 3, 0, True)], [(5, 3, 1, True)]], [Layout(2, 0), Layout(2, 1)]) is None
    assert plan([[], []], [Layout(2, 0), Layout(2, 1)]) is None


def test_pieces_cut_new_rows_at_old_chunk_borders() -> None:
    got = pieces({"w": 32}, [("w", "param")], 3, Layout(2, 1))
    assert [(p.chunk, p.start, p.stop) for p in got] == [(1, 16, 22), (2, 22, 32)]


def test_going_back_forgets_the_abandoned_timeline() -> None:
    from agents.state.buddy_copies import BuddyCopies
    from agents.state.sharding import Slice

    copies = BuddyCopies(every_steps=1)
    for step in (7, 8):
        copies._snapshots.append(Slice(step, Layout(2, 0), {}, {}))
    copies._held = Slice(8, Layout(2, 1), {})
    copies.forget_after(7)
    assert [sl.step for sl in copies.own_snapshots()] == [7]
    assert copies.held_copy() is None
    with pytest.raises(ValueError, match="every_steps must be at least 1"):
        BuddyCopies(every_steps=0)


def test_redundancy_is_said_to_be_ignored_for_models_that_make_no_copies() -> None:
    assert redundancy_ignored("fsdp", 1, 10) is None  # fsdp makes the copies
    assert redundancy_ignored("hsdp", 10, 10) is None  # the default: not set by the job file
    hsdp = redundancy_ignored("hsdp", 1, 10)
    assert hsdp is not None and "every_steps (1) is ignored" in hsdp and "twin" in hsdp
    ddp = redundancy_ignored("ddp", 0, 10)
    assert ddp is not None and "sharding='ddp'" in ddp and "every rank" in ddp
