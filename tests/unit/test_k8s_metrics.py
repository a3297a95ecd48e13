"""The controller's Prometheus metrics: the job label, and counters for every rate."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.api import JobPhase
from orchestrator.observe.metrics import JOB_LABEL, JobMetrics

pytestmark = pytest.mark.unit


def state(metrics: JobMetrics, step: int, productive: float) -> None:
    metrics.job_state(
        "j",
        phase=JobPhase.RUNNING,
        run=1,
        step=step,
        steps_per_s=1.0,
        samples_per_s=None,
        world_size=2,
        active=2,
        spares=1,
        failed=0,
        effective_ratio=0.5,
        productive_s=productive,
    )


def samples(metrics: JobMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_no_series_has_a_job_label_every_one_has_ringmaster_job() -> None:
    """Prometheus sets `job` to the scrape job: ours would be lost or renamed."""
    metrics = JobMetrics()
    state(metrics, 10, 5.0)
    found = samples(metrics)
    assert found
    for name, labels in found:
        keys = {k for k, _ in labels}
        assert "job" not in keys, name
        if not name.endswith("_created"):
            assert JOB_LABEL in keys, name


def test_steps_and_productive_time_are_counters_that_only_grow() -> None:
    metrics = JobMetrics()
    key = frozenset({(JOB_LABEL, "j")})
    state(metrics, 100, 50.0)  # the first sight only sets the base (a new leader)
    assert samples(metrics)[("ringmaster_job_steps_total", key)] == 0
    state(metrics, 130, 65.0)
    state(metrics, 120, 66.0)  # restored from a checkpoint: the counter does not go back
    state(metrics, 125, 70.0)
    got = samples(metrics)
    assert got[("ringmaster_job_steps_total", key)] == 30 + 5
    assert got[("ringmaster_job_productive_wall_seconds_total", key)] == 20.0
    types = {
        f.name: f.type
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
    }
    assert types["ringmaster_job_steps"] == "counter"
    assert types["ringmaster_job_step"] == "gauge"


def test_a_link_probe_sets_a_rate_per_measured_link() -> None:
    metrics = JobMetrics()
    metrics.link_rates("j", {"node-0": {"node-1": 12.5e6, "node-2": 1.2e6}})
    metrics.link_rates("j", {"node-0": {"node-1": 11.0e6}})  # a later probe: the last rate
    got = samples(metrics)

    def rate(sender: str, receiver: str) -> float:
        labels = {(JOB_LABEL, "j"), ("sender", sender), ("receiver", receiver)}
        return got[("ringmaster_link_bytes_per_second", frozenset(labels))]

    assert rate("node-0", "node-1") == 11.0e6 and rate("node-0", "node-2") == 1.2e6
