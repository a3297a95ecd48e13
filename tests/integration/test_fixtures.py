"""The shared fixtures themselves work: S3 over HTTP through s3fs, gloo processes."""

from __future__ import annotations

import pytest

from tests.gloo import GlooRunError

pytestmark = pytest.mark.integration


def test_s3_endpoint_round_trip_through_fsspec(s3) -> None:  # type: ignore[no-untyped-def]
    import fsspec

    fs, path = fsspec.core.url_to_fs(s3.url("fixture/hello.txt"), **s3.storage_options)
    with fs.open(path, "wb") as f:
        f.write(b"hello")
    assert s3.fs().cat(path) == b"hello"
    assert s3.endpoint_url.startswith("http://127.0.0.1:")


def _allreduce_rank(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


def _fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_gloo_runner_all_reduce(gloo) -> None:  # type: ignore[no-untyped-def]
    assert gloo(_allreduce_rank, 2) == [3.0, 3.0]


def test_gloo_runner_reports_rank_failure(gloo) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(GlooRunError, match="boom on rank 1"):
        gloo(_fail_on_rank_one, 2, timeout=60)
