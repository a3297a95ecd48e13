"""Slices of a sharded model moved between real gloo processes: every new row equals the old.

Two ranks hold the two old chunks of step 5; a third joins with nothing and
the rows are redistributed over three.  The pieces are of both kinds: rows of
a wide parameter and its bf16 moment, over a MiB each (sent by themselves,
straight into the receiver's new rows), and a narrow bias and a bool mask
(packed per dtype).  Each rank checks its new rows against the whole tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gloo import run_gloo

pytestmark = pytest.mark.integration

ROWS = 6000


def _whole() -> dict[tuple[str, str], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        ("w", "param"): torch.randn(ROWS, 256, generator=g),  # 1 KB a row
        ("w", "adam.exp_avg"): torch.randn(ROWS, 256, generator=g).to(torch.bfloat16),
        ("b", "param"): torch.randn(ROWS, generator=g),
        ("m", "param"): torch.rand(ROWS, 2, generator=g) > 0.5,
    }


def _redistribute(rank: int, world: int) -> dict[str, Any]:
    from agents.recovery import shard_transfer
    from agents.recovery.tensor_stream import DIRECT_BYTES
    from agents.state.sharding import Layout, chunk_rows

    whole = _whole()
    held = [[(5, 2, 0, True)], [(5, 2, 1, True)], []]
    new = [Layout(world, r) for r in range(world)]
    tp = shard_transfer.plan(held, new)
    assert tp is not None and tp.old == 2
    rows = {"w": ROWS, "b": ROWS, "m": ROWS}
    structure = {k: (t.dtype, tuple(t.shape[1:])) for k, t in whole.items()}

    def mine(chunk: int) -> dict[tuple[str, str], torch.Tensor] | None:
        if rank != chunk:
            return None
        a, b = chunk_rows(ROWS, Layout(2, chunk))
        return {k: t[a:b].clone() for k, t in whole.items()}

    lo, hi = chunk_rows(ROWS, new[rank])
    targets = {k: torch.zeros((hi - lo, *t.shape[1:]), dtype=t.dtype) for k, t in whole.items()}
    received = shard_transfer.execute(tp, rank, new, rows, structure, mine, targets)
    direct = any(
        (p.stop - p.start) * 256 * 4 >= DIRECT_BYTES
        for p in shard_transfer.pieces(rows, [("w", "param")], 2, new[rank])
        if tp.holder[(rank, p.chunk)] != rank
    )
    equal = {str(k): bool(torch.equal(targets[k], t[lo:hi])) for k, t in whole.items()}
    return {"received": received, "equal": equal, "direct": direct}


def test_redistributed_rows_equal_the_old_ones_whether_sent_alone_or_packed() -> None:
    ranks = run_gloo(_redistribute, 3, timeout=120)
    for rank, got in enumerate(ranks):
        assert all(got["equal"].values()), (rank, got)
    assert ranks[2]["received"] > 0 and ranks[2]["direct"]  # the newcomer got large pieces
