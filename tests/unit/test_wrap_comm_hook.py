"""``wrap()`` with a comm hook of the script's own and the job file's comm settings."""

from __future__ import annotations

import pytest
import torch

from agents.runtime.failures import CollectiveFailures
from agents.runtime.wrapping import WrappedModels
from orchestrator.spec.loader import load_job_data

pytestmark = pytest.mark.unit


def _models(comm: dict[str, object]) -> WrappedModels:
    spec = load_job_data({"name": "j", "entrypoint": {"script": "x.py"}, "comm": comm})
    return WrappedModels(spec, torch.device("cpu"), CollectiveFailures(), lambda ddp: None)


@pytest.mark.parametrize(
    "comm", [{"compression": {"type": "fp16"}}, {"hierarchical": True}], ids=["fp16", "hier"]
)
def test_the_scripts_hook_and_the_job_files_are_not_both_taken(comm: dict[str, object]) -> None:
    """DDP takes one comm hook: neither is dropped in silence."""
    models = _models(comm)
    with pytest.raises(ValueError, match=r"hook_installer=.*comm.compression.*remove one"):
        models.wrap(torch.nn.Linear(2, 2), lambda ddp: None, None, None, None)
    assert models.ddps == []


def test_the_scripts_hook_is_taken_where_the_job_file_asks_for_none() -> None:
    models = _models({})
    models.wrap(torch.nn.Linear(2, 2), lambda ddp: None, None, None, None)
    assert len(models.ddps) == 1
