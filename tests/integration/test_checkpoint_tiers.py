"""Restore picks the freshest valid source: memory on every rank, else a live peer.

Two gloo processes commit step 1 durably and keep step 2 in their memory
tiers.  Rank 1's node then "loses" its memory (a replacement node): the
restore must take step 2 from rank 0 over the network rather than fall back
to step 1 in storage.  With every rank's memory present, each restores locally.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.integration.checkpoint_workers import BATCH, durable_then_memory, restore_twice

pytestmark = pytest.mark.integration


def test_replacement_rank_gets_fresher_state_from_peer(gloo: Any, tmp_path: Any) -> None:
    url, shm = f"file://{tmp_path}/ckpt", str(tmp_path / "shm")
    saved = gloo(durable_then_memory, 2, url, shm)
    assert saved[0] == saved[1]
    shutil.rmtree(tmp_path / "shm" / "rank-1")

    results = gloo(restore_twice, 2, url, shm)
    for rank, (peer, memory) in enumerate(results):
        assert peer["source"] == "peer" and peer["step"] == 2
        assert peer["state"] == saved[0]
        assert peer["samples_seen"] == 2 * BATCH * 2
        # Rank 0 kept its own per-rank state; the replacement starts its own afresh.
        assert peer["rank_state_restored"] == (rank == 0)
        assert peer["residual"] == ([10.0] * 4 if rank == 0 else [0.0] * 4)

        assert memory["source"] == "memory" and memory["step"] == 3
        assert memory["state"] == saved[0]
        assert memory["rank_state_restored"]
