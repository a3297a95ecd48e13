"""Durable checkpoints of sharded state: every rank writes its own slice, any layout resumes.

An FSDP2 job of 2 real gloo processes saves; fresh processes restore it on 3
ranks (FSDP), on 2 ranks as DDP and on 4 ranks as HSDP (2 x 2), into models
initialised differently: model and optimizer state come back identical.  An
HSDP checkpoint resumes on 2 FSDP ranks, and a DDP checkpoint into FSDP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.sharded_workers import STEPS, resume, train_and_save

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return abs(float(a) - float(b)) <= 1e-6 * (1 + abs(float(a)))


@pytest.mark.long  # short form: the mesh checkpoints resumed across layouts below
def test_fsdp_checkpoint_resumes_on_three_ranks_into_ddp_and_hsdp(
    gloo: Any, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/ckpt"
    saved = gloo(train_and_save, 2, url, "fsdp")
    assert _close(saved[0]["state"], saved[1]["state"])
    # no gather to one rank: each rank wrote an object of its own
    assert sorted(saved[0]["objects"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for world, mode in ((3, "fsdp"), (2, "ddp"), (4, "hsdp")):
        for r, out in enumerate(gloo(resume, world, url, mode)):
            assert out["step"] == STEPS
            assert _close(out["state"], saved[0]["state"]), f"{mode} rank {r} of {world} differs"


@pytest.mark.long  # short form: the mesh checkpoints resumed across layouts below
def test_hsdp_and_ddp_checkpoints_resume_sharded(gloo: Any, tmp_path: Path) -> None:
    hsdp = f"file://{tmp_path}/hsdp"
    saved = gloo(train_and_save, 4, hsdp, "hsdp")
    for out in gloo(resume, 2, hsdp, "fsdp"):
        assert out["step"] == STEPS
        assert _close(out["state"], saved[0]["state"])
    ddp = f"file://{tmp_path}/ddp"
    saved = gloo(train_and_save, 2, ddp, "ddp")
    for out in gloo(resume, 3, ddp, "fsdp"):
        assert _close(out["state"], saved[0]["state"])


def test_a_fresh_start_leaves_an_unstepped_optimizer_without_state(tmp_path: Path) -> None:
    """Capturing the state to restore into gives Adam state (a zero-gradient step);
    with nothing to restore it must not stay: Adam's step count would start at 1."""
    import torch

    from checkpoint import Checkpointer, TrainState

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    ckpt = Checkpointer(f"file://{tmp_path}/empty", keep=1)
    result = ckpt.restore(TrainState(model, optimizer))
    ckpt.close()
    assert result.step is None
    assert not optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _merged(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole state from every rank's (a pipeline stage holds its own part only)."""
    merged: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for out in outs:
        for part, entries in out["state"].items():
            for key, value in entries.items():
                if key in merged[part]:
                    assert _close(merged[part][key], value), f"ranks differ on {part} {key}"
                merged[part][key] = value
    return merged


def test_mesh_checkpoints_resume_across_layouts(gloo: Any, tmp_path: Path) -> None:
    """replicate x tensor (2 x 2) → pipeline x tensor (2 x 2, a stage per 2 ranks) → DDP
    → shard x tensor (2 x 2): each resumes the one before (and saves it again): the same
    state, and the same loss on the next step as the run that saved (tensor parallel and
    micro-batches sum in another order: float tolerance)."""
    url = f"file://{tmp_path}/2-D"
    saved = gloo(train_and_save, 4, url, "mesh:1x1x2", 8)  # hidden 8: tensor parallel halves it
    assert _close(saved[0]["state"], saved[-1]["state"])
    # Linear(6, 8) split by output rows, Linear(8, 5) by input columns; its bias whole
    assert saved[0]["local_shapes"] == [(4, 6), (4,), (5, 4), (5,)], saved[0]["local_shapes"]
    want = _merged(saved)
    chain = (("3-D", 4, "mesh:2x1x2"), ("ddp", 2, "ddp"), ("shard-tensor", 4, "mesh:1x2x2"))
    for name, world, mode in chain:
        after = f"file://{tmp_path}/{name}"
        outs = gloo(resume, world, url, mode, 8, after)
        assert all(out["step"] == STEPS for out in outs)
        assert _close(_merged(outs), want), f"{url} → {name} differs"
        for out in outs:
            assert abs(out["next_loss"] - saved[0]["next_loss"]) <= 1e-5, (url, name, out)
        url = after
