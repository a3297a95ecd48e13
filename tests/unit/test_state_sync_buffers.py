"""The state sync's split into structure and tensors, and back; the messages that carry them."""

from __future__ import annotations

import pickle

import pytest
import torch

from agents.recovery.state_sync import join_tensors, split_tensors
from agents.recovery.tensor_stream import interleaved_runs, runs

pytestmark = pytest.mark.unit


def test_state_round_trips_through_its_structure_and_tensors() -> None:
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {
        "step": 7,
        "tracked": {"model": model.state_dict(), "optimizer": opt.state_dict()},
        "rng": torch.get_rng_state(),
        "mask": torch.tensor([True, False, True]),
        "pair": (torch.arange(4, dtype=torch.int64).view(2, 2), "label"),
    }
    skeleton, tensors = split_tensors(state)
    # the structure pickles small: no tensor data in it
    assert len(pickle.dumps(skeleton)) < 2000
    assert len({t.dtype for t in tensors}) == 4  # float32, uint8, bool, int64
    back = join_tensors(skeleton, [t.clone() for t in tensors])
    assert back["step"] == 7 and back["pair"][1] == "label"
    torch.testing.assert_close(back["rng"], state["rng"])
    assert torch.equal(back["mask"], state["mask"])
    assert torch.equal(back["pair"][0], state["pair"][0])
    fresh = torch.nn.Linear(8, 3)
    fresh.load_state_dict(back["tracked"]["model"])
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    fresh_opt.load_state_dict(back["tracked"]["optimizer"])
    assert torch.equal(
        fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )


def test_runs_cover_every_byte_once_in_order_and_no_message_exceeds_a_chunk() -> None:
    sizes = [0, 10, 5 << 20, 300, 1 << 20, 7, 0, (1 << 20) - 1, 3 << 20, *[900_000] * 3]
    chunk = 2 << 20
    plan = runs(sizes, chunk, direct_bytes=1 << 20)
    covered = [p for r in plan for p in r.pieces]
    # each tensor's bytes exactly once, in the tensors' order
    expected = []
    for i, size in enumerate(sizes):
        if size:
            expected.append((i, 0, size))
    merged: list[tuple[int, int, int]] = []
    for i, start, stop in covered:
        if merged and merged[-1][0] == i and merged[-1][2] == start:
            merged[-1] = (i, merged[-1][1], stop)
        else:
            merged.append((i, start, stop))
    assert merged == expected
    assert all(r.nbytes <= chunk for r in plan)
    # large tensors alone (sliced), runs of small ones packed together up to a chunk
    direct = [r.pieces[0][0] for r in plan if r.direct]
    assert direct == [2, 2, 2, 4, 8, 8] and all(len(r.pieces) == 1 for r in plan if r.direct)
    assert [r.pieces for r in plan if not r.direct] == [
        ((1, 0, 10),),
        ((3, 0, 300),),
        ((5, 0, 7), (7, 0, (1 << 20) - 1)),
        ((9, 0, 900_000), (10, 0, 900_000)),
        ((11, 0, 900_000),),
    ]


def test_runs_of_several_senders_take_turns_and_pack_one_senders_tensors_only() -> None:
    # tensors 0 and 2 from rank 0, 1 and 3 from rank 5; 1 and 3 small enough to pack
    got = interleaved_runs([0, 5, 0, 5], [300, 40, 250, 40], chunk_bytes=200)
    assert [(src, r.pieces) for r, src in got] == [
        (0, ((0, 0, 200),)),
        (5, ((1, 0, 40), (3, 0, 40))),  # packed together: both rank 5's
        (0, ((0, 200, 300),)),
        (0, ((2, 0, 200),)),
        (0, ((2, 200, 250),)),
    ]
    # every byte of every tensor once, whoever sends it
    pieces = [p for r, _ in got for p in r.pieces]
    assert sorted(pieces) == sorted(p for r in runs([300, 40, 250, 40], 200) for p in r.pieces)
