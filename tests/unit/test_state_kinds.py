"""What a session holds, by what the script wrapped: the kind of state, and the step participants.

The kind picks the join's recovery from the table (:mod:`agents.recovery.kinds`);
the participants are what the session's step loop calls beside the script's
step (:mod:`agents.runtime.participants`): a delayed sync's outer loop, a
sharded model's buddy copies.  Real :class:`~agents.runtime.wrapping.WrappedModels`,
real models; no process group is needed before the first generation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agents.recovery.kinds import RECOVERIES
from agents.runtime.failures import CollectiveFailures
from agents.runtime.participants import BuddySnapshots, DelayedSync
from agents.runtime.wrapping import WrappedModels
from agents.state.api import REPLICAS, SITE_SLICES, SITES, SLICES
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data

pytestmark = pytest.mark.unit

DILOCO = {"sync": {"mode": "diloco", "inner_steps": 4}}


def _models(**more: Any) -> WrappedModels:
    spec: JobSpec = load_job_data({"name": "j", "entrypoint": {"script": "x.py"}, **more})
    return WrappedModels(spec, torch.device("cpu"), CollectiveFailures(), lambda ddp: None)


@pytest.mark.parametrize(
    ("job", "sharding", "kind", "participants"),
    [
        ({}, None, REPLICAS, []),
        ({}, "hsdp", SLICES, []),
        ({"fault_tolerance": {"redundancy": {"every_steps": 2}}}, "fsdp", SLICES, [BuddySnapshots]),
        (DILOCO, None, SITES, [DelayedSync]),
        (
            {**DILOCO, "fault_tolerance": {"redundancy": {"every_steps": 2}}},
            "fsdp",
            SITE_SLICES,
            [DelayedSync, BuddySnapshots],  # the outer step first, then the snapshot
        ),
    ],
)
def test_what_the_script_wraps_names_its_kind_of_state_and_its_participants(
    job: dict[str, Any], sharding: str | None, kind: str, participants: list[type]
) -> None:
    models = _models(**job)
    models.wrap(torch.nn.Linear(4, 4), None, sharding, None, None)
    assert models.kind == kind and kind in RECOVERIES
    assert [type(p) for p in models.participants] == participants


def test_nothing_wrapped_is_replicas_of_the_tracked_objects() -> None:
    models = _models()
    assert models.kind == REPLICAS and models.participants == []
    assert models.replica() is None  # no DDP model: each rank sends its whole state


def test_one_ddp_model_averaged_every_step_is_held_alike_by_every_rank() -> None:
    models = _models()
    module = torch.nn.Linear(2, 2)
    models.wrap(module, None, None, None, None)
    assert models.replica() is module
    local_sgd = _models(comm={"compression": {"type": "localsgd"}})
    local_sgd.wrap(torch.nn.Linear(2, 2), None, None, None, None)
    assert local_sgd.replica() is None  # post-local SGD lets the replicas drift apart


def test_a_delayed_sync_takes_part_in_the_step_loop_through_the_participant_contract() -> None:
    models = _models(**DILOCO)
    models.wrap(torch.nn.Linear(2, 2), None, None, None, None)
    (sync,) = models.participants
    outer = models.outer
    assert isinstance(sync, DelayedSync) and outer is not None
    assert dict(sync.tracked()) == {"outer": outer}  # checkpointed and sent like the model
    sync.ends_at(10)
    assert outer.end == 10  # the last outer step lands on the global model
    outer.catch_up_to = 6
    assert sync.behind(6) and not sync.behind(7)  # a site catching up casts no vote
    assert sync.across_sites  # saves and stops are agreed in its rounds
    assert sync.step_groups() == () and sync.vote_group() is None  # no generation joined yet
    outer.agreed.update({4: (1, 2), 6: (3, 4)})
    assert sync.agreed(6) == (3, 4) and outer.agreed == {}  # an older agreement is dropped
    assert sync.newest_generation(3) == 3  # no site groups yet: this rank's own word
    figures = sync.telemetry()
    assert set(figures) == {
        "outer_steps",
        "site_bytes",
        "outer_wait_s",
        "last_outer_sync",
        "outer_left_out",
    }
