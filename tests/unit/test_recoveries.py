"""Recovery records, failure causes and the metric counters."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest

from orchestrator.api import JobPhase
from orchestrator.observe.metrics import JobMetrics
from orchestrator.observe.records import PHASES, RecoveryRecord
from orchestrator.observe.recoveries import (
    SLOWEST_KEPT,
    FailureCause,
    build_record,
    classify_cause,
    recovered_message,
    restart_phases,
)
from orchestrator.observe.training_time import training_time
from orchestrator.state.events import Event
from orchestrator.state.records import Telemetry

pytestmark = pytest.mark.unit


def ev(type: str, source: str = "controller", **data: object) -> Event:
    return Event(type=type, message="", time=100.0, source=source, data=dict(data))


@pytest.mark.parametrize(
    ("events", "registered", "cause"),
    [
        ([ev("WorkerExited", "n1", worker="n1-0", exit_code=-9)], ["n1"], FailureCause.SIGNAL),
        ([ev("WorkerExited", "n1", worker="n1-0", exit_code=3)], ["n1"], FailureCause.EXIT_CODE),
        (
            [
                ev("WorkerHung", worker="n1-0"),
                ev("WorkerExited", "n1", worker="n1-0", exit_code=-9),
            ],
            ["n1"],
            FailureCause.HANG,
        ),
        ([ev("Preempted", "n1")], [], FailureCause.PREEMPTION),
        ([], [], FailureCause.LEASE_EXPIRY),
        ([], ["n1"], FailureCause.UNRESPONSIVE),
        # another node's trouble says nothing about n1
        (
            [ev("WorkerExited", "n10", worker="n10-0", exit_code=1)],
            ["n1"],
            FailureCause.UNRESPONSIVE,
        ),
    ],
)
def test_classify_cause(events: list[Event], registered: list[str], cause: FailureCause) -> None:
    assert classify_cause({"n1"}, events, registered) is cause


def _worker(formed: float, restored: float, first: float, step: int = 7) -> dict[str, object]:
    return {
        "generation": 2,
        "group_formed_at": formed,
        "restored_at": restored,
        "restored_step": step,
        "first_step_at": first,
    }


def test_phases_come_from_the_slowest_worker_and_sum_to_the_total() -> None:
    r = build_record(
        generation=2,
        cause="signal",
        nodes=["n1"],
        reason="no report",
        failure_at=10.0,
        declared_at=11.0,
        workers={"a": _worker(11.2, 11.5, 11.6), "b": _worker(11.3, 11.4, 11.7)},
        step=7,
        observed_s=1.9,
    )
    assert r.phases == pytest.approx(
        {"detect": 1.0, "rendezvous": 0.3, "restore": 0.2, "first_step": 0.2}
    )
    assert sum(r.phases.values()) == pytest.approx(r.total_s) == pytest.approx(1.7)
    assert r.steps_rerun == 0
    again = RecoveryRecord.from_dict(r.to_dict())
    assert again.phases == r.phases and again.cause == "signal"
    assert r.ended_by == ""  # no worker's step had to be ended


def test_record_says_what_ended_the_failed_step() -> None:
    a, b, c = _worker(11.2, 11.5, 11.6), _worker(11.3, 11.4, 11.7), _worker(11.3, 11.4, 11.7)
    a["left_by"], b["left_by"] = "timeout", "abort"  # c is the replacement: it left nothing
    r = build_record(
        generation=2,
        cause="lease_expired",
        nodes=["n1"],
        reason="",
        failure_at=10.0,
        declared_at=11.0,
        workers={"a": a, "b": b, "c": c},
        step=7,
        observed_s=1.9,
    )
    assert r.ended_by == "abort+timeout"


def test_phase_boundaries_are_clamped_never_negative() -> None:
    # a worker clock a little behind the controller's: its times precede the declaration
    r = build_record(
        generation=3,
        cause="hang",
        nodes=["n1"],
        reason="",
        failure_at=10.0,
        declared_at=12.0,
        workers={"a": _worker(11.9, 11.95, 12.5, step=5)},
        step=8,
        observed_s=2.6,
    )
    assert all(r.phases[p] >= 0 for p in PHASES)
    assert r.phases["rendezvous"] == 0 and r.phases["restore"] == 0
    assert sum(r.phases.values()) == pytest.approx(r.total_s) == pytest.approx(2.5)
    assert r.steps_rerun == 3  # restored from step 5, had reached 8


def test_byte_counters_add_only_increases_and_survive_worker_restarts() -> None:
    m = JobMetrics()
    m.worker_telemetry("j", "n1-0", 100, Telemetry(wire_bytes=1000, dense_bytes=4000))
    m.worker_telemetry("j", "n1-0", 100, Telemetry(wire_bytes=1000, dense_bytes=4000))  # same beat
    m.worker_telemetry("j", "n1-0", 100, Telemetry(wire_bytes=1500, dense_bytes=6000))
    m.worker_telemetry("j", "n1-0", 200, Telemetry(wire_bytes=300, dense_bytes=1200))  # restarted
    text = generate_latest(m.registry).decode()
    assert 'ringmaster_job_comm_wire_bytes_total{ringmaster_job="j"} 1800.0' in text
    assert 'ringmaster_job_comm_dense_bytes_total{ringmaster_job="j"} 7200.0' in text
    assert 'ringmaster_job_comm_compression_ratio{ringmaster_job="j"} 4.0' in text


def test_phase_gauge_marks_only_the_current_phase() -> None:
    m = JobMetrics()
    m.job_state(
        "j",
        phase=JobPhase.RECOVERING,
        run=2,
        step=5,
        steps_per_s=0.0,
        samples_per_s=None,
        world_size=2,
        active=2,
        spares=0,
        failed=1,
        effective_ratio=0.5,
        productive_s=1.0,
    )
    text = generate_latest(m.registry).decode()
    assert 'ringmaster_job_phase{phase="Recovering",ringmaster_job="j"} 1.0' in text
    assert 'ringmaster_job_phase{phase="Running",ringmaster_job="j"} 0.0' in text
    assert 'ringmaster_job_nodes{ringmaster_job="j",state="failed"} 1.0' in text
    assert 'ringmaster_job_run{ringmaster_job="j"} 2.0' in text


def test_a_refused_liveness_probe_is_agent_gone_unless_a_worker_said_more() -> None:
    assert classify_cause({"n1"}, [], ["n1"], agent_gone={"n1"}) is FailureCause.AGENT_GONE
    exited = [ev("WorkerExited", "n1", worker="n1-0", exit_code=-9)]
    assert classify_cause({"n1"}, exited, ["n1"], agent_gone={"n1"}) is FailureCause.SIGNAL
    # another node's agent being gone says nothing about n1
    assert classify_cause({"n1"}, [], ["n1"], agent_gone={"n2"}) is FailureCause.UNRESPONSIVE


def test_a_recovery_of_1000_nodes_x_8_workers_stays_small() -> None:
    """The record keeps the slowest workers and counts the rest: etcd takes it at any scale."""
    workers: dict[str, dict[str, object]] = {}
    for i in range(8000):
        t = _worker(11.0 + i * 1e-4, 12.0 + i * 1e-4, 13.0 + i * 1e-4, step=7)
        t.update(
            wire_bytes=4_000_000_000,
            dense_bytes=4_000_000_000,
            left_by="abort",
            restored_from="twin",
            steps_lost=0,
            checkpoint_blocking_s=0.1,
        )
        workers[f"n{i // 8:05d}-{i % 8}"] = t
    workers["n00003-5"].update(restored_from="durable", steps_lost=4)  # not among the slowest
    workers["n00007-1"]["first_step_at"] = 20.0  # the one straggler
    r = build_record(
        generation=2,
        cause="agent_gone",
        nodes=["n09999"],
        reason="n00000 replaces n09999",
        failure_at=10.0,
        declared_at=10.5,
        workers=workers,
        step=7,
        observed_s=10.0,
    )
    assert len(r.encode().encode()) < 64 * 1024
    assert len(r.workers) <= 3 * SLOWEST_KEPT
    assert "n00007-1" in r.workers and "n00999-7" in r.workers  # they set the phases
    assert r.worker_count == 8000
    assert r.first_step_at == 20.0 and r.total_s == pytest.approx(10.0)
    assert r.source == "durable+twin" and r.steps_lost == 4 and r.ended_by == "abort"
    again = RecoveryRecord.from_dict(json.loads(r.encode()))
    assert (again.source, again.steps_lost, again.phases) == (r.source, r.steps_lost, r.phases)


def test_a_durable_restore_with_no_survivor_counts_from_the_step_that_broke() -> None:
    """A whole replica went: no worker held the lost steps to count them; the record
    counts the steps between the checkpoint restored and the step that broke."""
    workers = {f"n1-{i}": _worker(11.0, 12.0, 13.0, step=20) for i in range(2)}
    for t in workers.values():
        t.update(restored_from="durable", steps_lost=0)
    r = build_record(
        generation=2,
        cause="lease_expiry",
        nodes=["n0"],
        reason="lease expired: n0",
        failure_at=10.0,
        declared_at=10.5,
        workers=workers,
        step=27,
        observed_s=3.0,
    )
    assert (r.source, r.restored_step, r.steps_lost) == ("durable", 20, 7)
    workers = {f"n1-{i}": _worker(11.0, 12.0, 13.0, step=20) for i in range(2)}
    r = build_record(
        generation=2,
        cause="agent_gone",
        nodes=["n0"],
        reason="",
        failure_at=10.0,
        declared_at=10.5,
        workers=workers,
        step=27,
        observed_s=3.0,
    )
    assert r.steps_lost == 0  # not a sharded model's restore: steps_rerun says it


def test_a_record_stored_before_the_summary_fields_still_reads() -> None:
    old = {
        "v": 1,
        "generation": 2,
        "cause": "hang",
        "nodes": ["n1"],
        "reason": "",
        "failure_at": 1.0,
        "declared_at": 2.0,
        "group_formed_at": 3.0,
        "restored_at": 4.0,
        "first_step_at": 5.0,
        "workers": {"a": {"restored_from": "buddy", "steps_lost": 1}, "b": {"steps_lost": 2}},
    }
    r = RecoveryRecord.from_dict(old)
    assert (r.source, r.steps_lost, r.total_s) == ("buddy", 2, 4.0)


def test_a_restart_tier_recovery_says_what_it_measured() -> None:
    """The restart tier's scripts report no steps: the message names the relaunch and,
    when the agents report it, the script's first output; never a 'first step'."""

    def record(first_output: float | None) -> RecoveryRecord:
        at = first_output or 10.5
        workers = {"b-0": {"group_formed_at": 10.5, "restored_at": at, "first_step_at": at}}
        return build_record(
            generation=2,
            cause="agent_gone",
            nodes=["a"],
            reason="r",
            failure_at=10.0,
            declared_at=10.1,
            workers=workers,
            step=0,
            observed_s=0.6,
        )

    relaunched = recovered_message(record(None), restart_tier=True)
    assert relaunched == (
        "generation 2: every worker relaunched 0.50s after the failure (agent_gone): detect "
        "0.10s, relaunch 0.40s; the script's next progress was not reported (its steps are "
        "its own)"
    )
    progressed = recovered_message(record(10.8), restart_tier=True)
    assert progressed == (
        "generation 2: the script made progress again (its first line of output) 0.80s after "
        "the failure (agent_gone): detect 0.10s, relaunch 0.40s, to the first output 0.30s"
    )
    assert "first step" not in relaunched + progressed
    assert recovered_message(record(10.8), restart_tier=False).startswith(
        "generation 2 trains again 0.80s after the failure (agent_gone): detect 0.10s"
    )
    assert restart_phases(record(None).phases) == pytest.approx({"detect": 0.1, "relaunch": 0.4})


def test_a_wait_for_a_spare_is_shown_apart_from_detection() -> None:
    """The replacement waited 3.1 s for a spare still starting before it was declared:
    part of the detect phase, but not detection; the phases still add up."""

    def record(spare_wait_s: float) -> RecoveryRecord:
        return build_record(
            generation=2,
            cause="signal",
            nodes=["b"],
            reason="c replaces b; the spare was still starting: 3.1s",
            failure_at=10.0,
            declared_at=13.4,
            workers={"c": _worker(13.6, 13.8, 14.1)},
            step=7,
            observed_s=4.2,
            spare_wait_s=spare_wait_s,
        )

    r = record(3.1)
    assert r.spare_wait_s == pytest.approx(3.1)
    assert r.phases == pytest.approx(
        {"detect": 3.4, "rendezvous": 0.2, "restore": 0.2, "first_step": 0.3}
    )
    assert sum(r.phases.values()) == pytest.approx(r.total_s) == pytest.approx(4.1)
    assert recovered_message(r, restart_tier=False) == (
        "generation 2 trains again 4.10s after the failure (signal): detect 3.40s (of which "
        "3.10s waiting for a spare), rendezvous 0.20s, restore 0.20s, first step 0.30s"
    )
    assert "detect 3.40s (of which 3.10s waiting for a spare), relaunch 0.20s" in (
        recovered_message(r, restart_tier=True)
    )
    again = RecoveryRecord.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again.spare_wait_s == pytest.approx(3.1) and again.phases == r.phases
    # a wait longer than the time to the declaration (clocks apart) is cut to it
    assert record(5.0).spare_wait_s == pytest.approx(3.4)
    # no wait: the message is as before, and an older record reads as no wait
    assert "detect 3.40s, rendezvous" in recovered_message(record(0.0), restart_tier=False)
    old = r.to_dict()
    del old["spare_wait_s"]
    assert RecoveryRecord.from_dict(old).spare_wait_s == 0.0
    # the whole recovery, wait included, is still time lost to failures
    split = training_time(
        submitted_at=0.0,
        train_started_at=5.0,
        last_step_at=20.0,
        end=20.0,
        steps=10,
        recoveries=[r],
    )
    assert split.recovering_s == pytest.approx(r.total_s)
