"""The two-rank golden checkpoint restores on real gloo ranks, at its own world size and another.

See :mod:`tests.checkpoint_golden`: it was written by two ranks with the
private DCP entry points the package no longer uses.  Each rank of a new
group restores it and reports what it got; ranks the checkpoint knew get
their own ``rank_state`` back, a rank it did not know keeps its own.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint_golden import GOLDEN_ROOT, SAMPLES_SEEN, STEP, build_state, expected_state

pytestmark = pytest.mark.integration


def _restore(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from checkpoint import Checkpointer
    from tests.checkpoint_golden import fresh_state

    state = fresh_state()
    result = Checkpointer(f"file://{root}").restore(state)
    # Plain lists: tensors would cross to the parent as shared memory of an exiting process.
    residual = state.rank_state.get("residual")
    return {
        "step": result.step,
        "samples_seen": result.samples_seen,
        "rank_state_restored": result.rank_state_restored,
        "count": state.rank_state.get("count"),
        "residual": None if residual is None else residual.tolist(),
        "model": {k: v.tolist() for k, v in state.model.state_dict().items()},
        "counter": state.objects["counter"].value,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_two_rank_golden_checkpoint_restores_on_gloo_ranks(
    gloo: Any, tmp_path: Path, world_size: int
) -> None:
    root = tmp_path / "two-ranks"
    shutil.copytree(GOLDEN_ROOT / "two-ranks", root)
    results = gloo(_restore, world_size, str(root))
    expected_model = expected_state()["model"]
    for rank, got in enumerate(results):
        assert got["step"] == STEP and got["samples_seen"] == SAMPLES_SEEN
        assert got["counter"] == 5
        for key, value in expected_model.items():
            restored = torch.tensor(got["model"][key], dtype=value.dtype)
            torch.testing.assert_close(restored, value, rtol=1e-5, atol=1e-6)
        if rank < 2:
            assert got["rank_state_restored"], rank
            expected = build_state(rank).rank_state
            assert got["count"] == expected["count"]
            assert got["residual"] == expected["residual"].tolist()
        else:
            assert not got["rank_state_restored"]
            assert got["count"] is None and got["residual"] is None
