"""Which device and backend a worker takes for its local rank.

This machine has no GPU: torch's device count is replaced here (a stand-in for
a node that shows two CUDA devices); tests/cuda runs the real thing on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from agents.api import RecoveryError
from agents.runtime.process_group import choose_device

pytestmark = pytest.mark.unit


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    bound: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    return bound


def test_local_ranks_past_the_devices_share_them_on_gloo(two_gpus: list[int]) -> None:
    """`oversubscribe: true` with comm.backend gloo: four workers on two GPUs."""
    got = [choose_device("gloo", r) for r in range(4)]
    assert [d.index for _, d in got] == [0, 1, 0, 1]
    assert {b for b, _ in got} == {"gloo"} and two_gpus == [0, 1, 0, 1]


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_nccl_takes_one_rank_per_device(two_gpus: list[int], backend: str) -> None:
    assert choose_device(backend, 1) == ("nccl", torch.device("cuda", 1))
    with pytest.raises(RecoveryError, match=r"NCCL takes one rank per device.*comm.backend: gloo"):
        choose_device(backend, 2)


def test_no_device_means_gloo_on_the_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine shows a CUDA device")
    assert choose_device("auto", 3) == ("gloo", torch.device("cpu"))
