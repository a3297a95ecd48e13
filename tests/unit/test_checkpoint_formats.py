"""Checkpoints already written keep loading, and new ones are laid out the same way.

The golden checkpoints under ``tests/data/checkpoints`` were written with
torch's private DCP entry points (see :mod:`tests.checkpoint_golden`); the
package now uses only public ones and its own key flattening.  These tests
restore the golden checkpoints into differently initialised state and check
every part, and check that a save made today names its entries and objects
exactly as the golden ones do.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import Checkpointer, CheckpointMismatchError, RestoreSource, TrainState
from checkpoint.flat_state import capture, flatten, unflatten
from tests.checkpoint_golden import (
    GOLDEN_ROOT,
    SAMPLES_SEEN,
    STEP,
    build_state,
    expected_state,
    fresh_state,
)

pytestmark = pytest.mark.unit


def _step_dir(root: Path) -> Path:
    (found,) = [p for p in root.iterdir() if p.name.startswith("step-")]
    return found


def _copy(name: str, tmp_path: Path) -> Path:
    # The checkpointer writes a probe object under its root: never into the repository.
    target = tmp_path / name
    shutil.copytree(GOLDEN_ROOT / name, target)
    return target


def _metadata(step_dir: Path) -> Any:
    with open(step_dir / ".metadata", "rb") as f:
        return pickle.load(f)


def _close(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype, where
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=where)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), where
        for key in expected:
            _close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _close(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def _assert_restored(
    state: TrainState, rank: int, *, rank_state: bool, saved: TrainState | None = None
) -> None:
    """``state`` holds what the golden checkpoints hold, or what ``saved`` held."""
    expected = build_state(rank)
    golden = expected_state()
    if saved is not None:
        assert saved.optimizer is not None and saved.scheduler is not None
        golden = {
            "model": saved.model.state_dict(),
            "optimizer": saved.optimizer.state_dict(),
            "scheduler": saved.scheduler.state_dict(),
        }
    assert state.optimizer is not None
    _close(state.model.state_dict(), golden["model"], "model")
    _close(state.optimizer.state_dict(), golden["optimizer"], "optim")
    # A scheduler saved by a newer torch may carry fields an older one does not know.
    sched, expected_sched = state.scheduler.state_dict(), golden["scheduler"]
    _close({k: sched.get(k) for k in expected_sched}, expected_sched, "sched")
    assert state.extra == expected.extra
    assert state.objects["counter"].value == 5
    assert state.samples_seen == SAMPLES_SEEN
    if rank_state:
        _close(state.rank_state, expected.rank_state, "rank_state")
    else:
        assert state.rank_state == {}


def test_single_process_checkpoint_of_the_private_api_era_restores(tmp_path: Path) -> None:
    root = _copy("single", tmp_path)
    state = fresh_state()
    result = Checkpointer(f"file://{root}").restore(state)
    assert result.source is RestoreSource.DURABLE and result.step == STEP
    assert result.rank_state_restored
    _assert_restored(state, 0, rank_state=True)


def test_two_rank_checkpoint_restores_in_one_process(tmp_path: Path) -> None:
    root = _copy("two-ranks", tmp_path)
    state = fresh_state()
    result = Checkpointer(f"file://{root}").restore(state)
    assert result.step == STEP and result.samples_seen == SAMPLES_SEEN
    # Rank 0's own blob is there; the replicated state was spread over two files.
    assert result.rank_state_restored
    _assert_restored(state, 0, rank_state=True)


def test_flat_keys_are_those_of_the_golden_checkpoints() -> None:
    flat, paths = capture(build_state(0), rank=0)
    saved = _metadata(_step_dir(GOLDEN_ROOT / "single")).state_dict_metadata
    assert set(flat) == set(saved)
    two_ranks = _metadata(_step_dir(GOLDEN_ROOT / "two-ranks")).state_dict_metadata
    assert set(two_ranks) == set(flat) | {"rank.1"}
    # Tensors stayed tensors and everything else travelled as bytes.
    for key, value in flat.items():
        assert hasattr(saved[key], "size") == isinstance(value, torch.Tensor), key
    assert paths["optim.state.3.weight.exp_avg"] == ("optim", "state", "3.weight", "exp_avg")
    assert paths["optim.param_groups.0.betas"] == ("optim", "param_groups", 0, "betas")


def test_a_save_today_is_laid_out_like_the_golden_one(tmp_path: Path) -> None:
    ckpt = Checkpointer(f"file://{tmp_path}/now")
    saved = build_state(0)
    manifest = ckpt.save_now(STEP, saved)
    ckpt.close()
    now = _step_dir(tmp_path / "now")
    golden = _step_dir(GOLDEN_ROOT / "single")
    assert sorted(o.path for o in manifest.objects) == [".metadata", "__0_0.distcp"]
    old_manifest = json.loads((golden / "manifest.json").read_text())
    new_manifest = json.loads((now / "manifest.json").read_text())
    assert set(new_manifest) == set(old_manifest)
    assert new_manifest["format"] == old_manifest["format"]
    assert new_manifest["checksum_algorithm"] == old_manifest["checksum_algorithm"]
    new_meta, old_meta = _metadata(now), _metadata(golden)
    assert set(new_meta.state_dict_metadata) == set(old_meta.state_dict_metadata)
    for key, entry in old_meta.state_dict_metadata.items():
        assert type(new_meta.state_dict_metadata[key]) is type(entry), key
    # And what it wrote restores like the golden one.
    state = fresh_state()
    assert Checkpointer(f"file://{tmp_path}/now").restore(state).step == STEP
    _assert_restored(state, 0, rank_state=True, saved=saved)


def test_flatten_enters_mappings_and_lists_holding_tensors_only() -> None:
    t = torch.zeros(2)
    nested = {
        "m": {"a": t, 1: {"b": 3}, "empty": {}},
        "tensors": [t, 5],
        "deep": [[t], "x"],
        "dicts": [{"lr": 0.1}, {"lr": 0.2}],
        "names": ["w", "b"],
        "pair": (t, t),
    }
    flat, paths = flatten(nested)
    assert set(flat) == {
        "m.a",
        "m.1.b",
        "tensors.0",
        "tensors.1",
        "deep.0.0",
        "deep.1",
        "dicts.0.lr",
        "dicts.1.lr",
        "names",
        "pair",
    }
    assert flat["names"] == ["w", "b"] and flat["pair"] == (t, t)
    assert paths["m.1.b"] == ("m", "1", "b") and paths["deep.0.0"] == ("deep", 0, 0)
    back = unflatten(flat, paths)
    # An empty mapping has no entry to carry it; everything else comes back, lists as lists.
    assert back == {
        "m": {"a": t, "1": {"b": 3}},
        "tensors": [t, 5],
        "deep": [[t], "x"],
        "dicts": [{"lr": 0.1}, {"lr": 0.2}],
        "names": ["w", "b"],
        "pair": (t, t),
    }


def test_flatten_refuses_two_paths_with_one_key() -> None:
    with pytest.raises(CheckpointMismatchError, match=r"'a\.b'"):
        flatten({"a.b": 1, "a": {"b": 2}})


def test_single_process_saves_hide_only_dcps_single_process_note(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt = Checkpointer(f"file://{tmp_path}/quiet")
        ckpt.save_now(1, build_state(0))
        Checkpointer(f"file://{tmp_path}/quiet").restore(fresh_state())
        with pytest.raises(UserWarning, match="something else"):
            warnings.warn("something else", UserWarning, stacklevel=1)
