"""The controller's etcd status record mapped into the TrainingJob status."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from orchestrator.api import JobPhase
from orchestrator.operator.status import build_status, invalid_status, rfc3339
from orchestrator.spec.job import EntrypointSpec, JobSpec, NodesSpec
from orchestrator.state.records import JobStatus

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
SPEC = JobSpec(name="demo", entrypoint=EntrypointSpec(script="t.py"), nodes=NodesSpec(2, 3, 1))


def status(
    controller: dict[str, Any] | None,
    old: dict[str, Any] | None = None,
    now: datetime = T0,
    **kw: Any,
) -> dict[str, Any]:
    args: dict[str, Any] = dict(pods=[], desired_pods=4, replaced=0, next_index=4, generation=2)
    args.update(kw)
    return build_status(spec=SPEC, controller=controller, old=old or {}, now=now, **args)


def conditions(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in st["conditions"]}


def test_controller_record_maps_field_by_field() -> None:
    record = JobStatus(
        name="demo",
        phase=JobPhase.RUNNING,
        step=420,
        world_size=6,
        generation=3,
        active_nodes=["demo-agent-0", "demo-agent-1", "demo-agent-2"],
        spare_nodes=["demo-agent-3"],
        recoveries=2,
        last_checkpoint="s3://b/ckpt/step-400",
        message="training",
        updated_at=T0.timestamp(),
    ).to_dict()
    st = status(record)
    assert st["phase"] == "Running"
    assert st["step"] == 420 and st["worldSize"] == 6 and st["generation"] == 3
    assert st["activePods"] == ["demo-agent-0", "demo-agent-1", "demo-agent-2"]
    assert st["sparePods"] == ["demo-agent-3"]
    assert st["activeCount"] == 3 and st["spareCount"] == 1
    assert st["recoveries"] == 2
    assert st["lastCheckpoint"] == "s3://b/ckpt/step-400"
    assert st["updatedAt"] == "2026-01-02T03:04:05Z"
    assert st["observedGeneration"] == 2
    cond = conditions(st)
    assert cond["Ready"]["status"] == "True"
    assert cond["Recovering"]["status"] == "False"
    assert cond["SparesAvailable"]["status"] == "True"
    assert cond["Finished"]["status"] == "False"


def test_no_record_yet_is_pending() -> None:
    st = status(None)
    assert st["phase"] == "Pending" and st["step"] == 0
    assert "lastCheckpoint" not in st
    assert conditions(st)["Ready"]["status"] == "False"
    assert conditions(st)["SparesAvailable"]["reason"] == "TooFew"


def test_recovering_and_finished() -> None:
    st = status({"phase": "Recovering", "message": "node demo-agent-1 lost"})
    assert conditions(st)["Recovering"]["status"] == "True"
    assert conditions(st)["Recovering"]["message"] == "node demo-agent-1 lost"
    st = status({"phase": "Failed", "message": "max_restarts reached"})
    assert conditions(st)["Finished"] == {
        **conditions(st)["Finished"],
        "status": "True",
        "reason": "Failed",
    }


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first = status({"phase": "Running"})
    later = T0 + timedelta(minutes=5)
    same = status({"phase": "Running", "step": 10}, old=first, now=later)
    assert conditions(same)["Ready"]["lastTransitionTime"] == rfc3339(T0)
    changed = status({"phase": "Recovering"}, old=same, now=later)
    assert conditions(changed)["Ready"]["lastTransitionTime"] == rfc3339(later)
    assert conditions(changed)["Recovering"]["lastTransitionTime"] == rfc3339(later)


def test_replacements_accumulate() -> None:
    st = status(None, old={"replacedPods": 3}, replaced=2)
    assert st["replacedPods"] == 5


def test_ready_pods_are_counted_from_pod_conditions() -> None:
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    not_ready = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert status(None, pods=[ready, not_ready, {}])["readyPods"] == 1


def test_unknown_controller_phase_reads_as_pending() -> None:
    assert status({"phase": "Exploding"})["phase"] == "Pending"


def test_invalid_spec_status_keeps_the_rest() -> None:
    old = status({"phase": "Running", "step": 7})
    st = invalid_status(old, "nodes.min (4) is larger than nodes.max (2)", generation=5, now=T0)
    assert st["phase"] == "Invalid" and st["step"] == 7
    assert st["observedGeneration"] == 5
    spec_valid = conditions(st)["SpecValid"]
    assert spec_valid["status"] == "False" and "nodes.min" in spec_valid["message"]
