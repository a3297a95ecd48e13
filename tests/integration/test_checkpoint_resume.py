"""Save at world size 2, resume at 1 and at 3, over a real S3 API endpoint and file://.

Real gloo processes train a tiny DDP model on an elastic sampler and save
asynchronously; fresh processes at another world size restore into
differently initialised models.  Model, optimizer and scheduler must come
back identical, and the data stream must continue exactly where it stopped.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from checkpoint.data_position import ElasticSampler
from tests.integration.checkpoint_workers import BATCH, DATASET, STEPS, resume, train_and_save

pytestmark = pytest.mark.integration


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
    """A fresh checkpoint root URL and its storage options, per backend."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt", {}
    s3 = request.getfixturevalue("s3")
    return s3.url(f"resume-{uuid.uuid4().hex[:8]}"), s3.storage_options


def test_save_at_two_resume_at_one_and_three(gloo: Any, target: tuple[str, dict[str, Any]]) -> None:
    url, options = target
    saved = gloo(train_and_save, 2, url, options)
    # Replicated DDP state was identical on both ranks and written once, spread
    # over both ranks: each rank wrote one data object.
    assert saved[0]["state"] == saved[1]["state"]
    assert sorted(saved[0]["objects"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    consumed = sorted(i for r in saved for i in r["consumed"])
    samples_seen = STEPS * BATCH * 2
    order = ElasticSampler(DATASET, 0, 1, seed=3)
    expected_consumed = sorted(order.global_index(p) for p in range(samples_seen))
    assert consumed == expected_consumed

    for world in (1, 3):
        # World size 1 runs in this process (no process group); 3 in gloo processes.
        resumed = [resume(0, 1, url, options)] if world == 1 else gloo(resume, world, url, options)
        for r, out in enumerate(resumed):
            assert out["source"] == "durable"
            assert out["step"] == STEPS
            assert out["samples_seen"] == samples_seen
            assert out["state"] == saved[0]["state"], f"rank {r} of {world} differs"
            if r < 2:
                assert out["rank_state_restored"]
                assert out["rank_state"] == [1.0 + r] * 4
            else:
                assert not out["rank_state_restored"]
                assert out["rank_state"] == [0.0] * 4
        # Next global batch: positions samples_seen .. samples_seen + BATCH*world,
        # dealt round-robin, none of them consumed before.
        nxt = sorted(i for out in resumed for i in out["next"])
        expected = sorted(
            order.global_index(p) for p in range(samples_seen, samples_seen + BATCH * world)
        )
        assert nxt == expected
        assert not set(nxt) & set(consumed) or samples_seen + BATCH * world > DATASET
