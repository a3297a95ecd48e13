"""Resuming under another job spec: a correct restore, or a clear typed error, never garbage.

A checkpoint saved under one job spec hash is restored by a job with another
hash: with the same model it restores exactly (a spec change such as more
steps is legitimate, and the manifest keeps the hash that produced it); with a
model of other shapes or other layers it is refused with
:class:`CheckpointMismatchError` naming the tensors, and the checkpoint stays
committed.  Resuming at another world size is a reshard, covered by
``test_checkpoint_resume.py`` (2 ranks saved, 1 and 3 restored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import Checkpointer, CheckpointMismatchError, TrainState

pytestmark = pytest.mark.integration


def build(hidden: int, extra_layer: bool = False, seed: int = 0) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2)]
    if extra_layer:
        layers.append(torch.nn.Linear(2, 2))
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, Any]:
    """A checkpoint at step 5 of an 8-wide model, saved under spec hash 'aaaa'."""
    url = f"file://{tmp_path}/ckpt"
    model, optimizer = build(8)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    ckpt = Checkpointer(url, keep=2, job_spec_hash="aaaa")
    manifest = ckpt.save_now(5, TrainState(model, optimizer))
    ckpt.close()
    assert manifest is not None and manifest.job_spec_hash == "aaaa"
    return url, model


def test_same_model_under_another_spec_restores_exactly(saved: tuple[str, Any]) -> None:
    url, original = saved
    model, optimizer = build(8, seed=99)
    ckpt = Checkpointer(url, keep=2, job_spec_hash="bbbb")
    result = ckpt.restore(TrainState(model, optimizer))
    info = ckpt.latest()
    ckpt.close()
    assert result.step == 5
    for a, b in zip(model.state_dict().values(), original.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert info is not None and info.manifest is not None
    assert info.manifest.job_spec_hash == "aaaa"  # the record of who produced it


@pytest.mark.parametrize(
    ("hidden", "extra_layer", "says"),
    [
        (16, False, r"model\.0\.weight \(8, 6\) in the checkpoint, \(16, 6\) here"),
        (8, True, "lacks"),
    ],
)
def test_another_model_is_refused_and_the_checkpoint_kept(
    saved: tuple[str, Any], hidden: int, extra_layer: bool, says: str
) -> None:
    url, _ = saved
    model, optimizer = build(hidden, extra_layer, seed=99)
    before = [p.detach().clone() for p in model.parameters()]
    ckpt = Checkpointer(url, keep=2, job_spec_hash="cccc")
    with pytest.raises(CheckpointMismatchError, match=says) as caught:
        ckpt.restore(TrainState(model, optimizer))
    assert "ckpt/step-0000000005" in str(caught.value)  # names the checkpoint
    info = ckpt.latest()
    ckpt.close()
    assert info is not None and info.step == 5 and info.manifest is not None  # not lost
    for a, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(a, b)  # nothing half-loaded into the model
