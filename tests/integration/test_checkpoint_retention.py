"""Retention over a real S3 API endpoint and file://.

Old committed checkpoints go once newer ones commit, directories of crashed
saves are cleaned, and the newest committed checkpoint always survives, even
when every later save failed.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from checkpoint import Checkpointer, CheckpointError, TrainState
from checkpoint.commit import list_checkpoints
from tests.integration.checkpoint_workers import build, faulty_filesystem

pytestmark = pytest.mark.integration


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
    """A fresh checkpoint root URL and its storage options, per backend."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt", {}
    s3 = request.getfixturevalue("s3")
    return s3.url(f"retention-{uuid.uuid4().hex[:8]}"), s3.storage_options


def test_retention_keeps_newest_committed_through_failures(
    target: tuple[str, dict[str, Any]],
) -> None:
    url, options = target
    model, optimizer, scheduler = build(seed=0)
    state = TrainState(model, optimizer, scheduler)
    good = Checkpointer(url, storage_options=options, keep=2)
    for step in (1, 2, 3):
        good.save_now(step, state)
    assert [i.step for i in good.list()] == [2, 3]

    # Two later saves fail half-way: nothing new commits, nothing old is lost.
    broken = Checkpointer(
        url,
        storage_options=options,
        filesystem=faulty_filesystem(url, options, ".distcp", "error"),
        keep=1,
    )
    for step in (4, 5):
        with pytest.raises(CheckpointError):
            broken.save_now(step, state)
    assert [i.step for i in good.list() if i.committed] == [2, 3]

    # The next good save commits, then retention (keep=2) drops step 2 and the
    # dead directories of steps 4 and 5 that it has now overtaken.
    good.save_now(6, state)
    infos = list_checkpoints(good.root)
    assert [(i.step, i.committed) for i in infos] == [(3, True), (6, True)]
