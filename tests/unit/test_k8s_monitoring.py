"""k8s/monitoring: the ServiceMonitor finds the operator's metrics Services, and the Grafana
dashboard asks only for series the controller exports, by ``ringmaster_job``, with rates of
``_total`` counters."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.api import JobPhase
from orchestrator.observe.metrics import JobMetrics
from orchestrator.observe.records import RecoveryRecord
from orchestrator.operator.api import Observed, OperatorSettings
from orchestrator.operator.reconcile import reconcile
from orchestrator.state.records import Telemetry, TrainingTime

pytestmark = pytest.mark.unit

MONITORING = Path(__file__).resolve().parents[2] / "k8s" / "monitoring"
DASHBOARD = json.loads((MONITORING / "grafana-dashboard.json").read_text(encoding="utf-8"))
EXPRS = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]


def exported() -> dict[str, str]:
    """Every sample name the controller exports, with its family's type."""
    m = JobMetrics()
    m.job_state(
        "j",
        phase=JobPhase.RUNNING,
        run=1,
        step=5,
        steps_per_s=1.0,
        samples_per_s=8.0,
        world_size=2,
        active=2,
        spares=1,
        failed=0,
        effective_ratio=0.9,
        productive_s=4.0,
    )
    m.training_time("j", TrainingTime(wall_s=10.0, startup_s=5.0, productive_s=5.0))
    m.checkpoint("j", 0.1, 1.0)
    m.recovery(
        "j",
        RecoveryRecord(
            generation=2,
            cause="agent_gone",
            nodes=["n1"],
            reason="n1 gone",
            failure_at=0.0,
            declared_at=0.5,
            group_formed_at=1.0,
            restored_at=1.5,
            first_step_at=2.0,
        ),
    )
    m.worker_telemetry("j", "n0", 1, Telemetry(wire_bytes=10, dense_bytes=40))
    text = generate_latest(m.registry).decode()
    return {s.name: f.type for f in text_string_to_metric_families(text) for s in f.samples}


def test_servicemonitor_selects_the_metrics_service_the_operator_creates() -> None:
    (monitor,) = [d for d in yaml.safe_load_all((MONITORING / "servicemonitor.yaml").read_text())]
    assert monitor["kind"] == "ServiceMonitor"
    plan = reconcile(
        {
            "metadata": {"name": "demo", "namespace": "ml", "uid": "u"},
            "spec": {"entrypoint": {"script": "t.py"}},
        },
        Observed(),
        None,
        OperatorSettings(etcd_endpoints=("e:2379",)),
        datetime(2026, 1, 1, tzinfo=timezone.utc),
    )
    services = [o for o in plan.create if o["kind"] == "Service"]
    chosen = [
        s
        for s in services
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in chosen] == ["demo-metrics"]  # not the agents' Service
    ports = {p["name"] for p in chosen[0]["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_dashboard_asks_only_for_exported_series() -> None:
    names = exported()
    assert EXPRS
    for expr in EXPRS:
        used = set(re.findall(r"\bringmaster_job_[a-z_]+\b", expr))
        assert used, expr
        for name in used:
            assert name in names, f"{name} (in {expr}) is not exported"


def test_dashboard_uses_the_ringmaster_job_label_never_job() -> None:
    for expr in EXPRS:
        assert 'ringmaster_job=~"$ringmaster_job"' in expr, expr
        assert not re.search(r"[{,(]\s*job\s*[=!~]|by \((?:[^)]*\b)?job\b", expr), expr
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert "ringmaster_job" in variables


def test_rates_only_of_counters() -> None:
    """rate()/increase() of a gauge is wrong in Prometheus: every one is of a counter."""
    names = exported()
    seen = 0
    for expr in EXPRS:
        for name in re.findall(r"(?:rate|increase)\(\s*(ringmaster_job_[a-z_]+)", expr):
            seen += 1
            counter = name.endswith("_total") and names[name] == "counter"
            bucket = name.endswith("_bucket") and names[name] == "histogram"
            assert counter or bucket, f"{name} is not a counter: {expr}"
    assert seen >= 5


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    joined = "\n".join(EXPRS)
    for wanted in (
        "rate(ringmaster_job_steps_total",  # step rate
        "ringmaster_job_productive_wall_seconds_total",  # effective training
        "ringmaster_job_recoveries_total",
        "ringmaster_job_last_recovery_phase_seconds",  # recovery phase timings
        "ringmaster_job_checkpoints_total",
        "ringmaster_job_spare_nodes",
    ):
        assert wanted in joined
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))


def _dashboard_configmap() -> dict[str, Any]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(MONITORING)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return dict(cm)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_the_dashboard_configmap_offline() -> None:
    cm = _dashboard_configmap()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["grafana-dashboard.json"]) == DASHBOARD
    assert kubernetes_validate.validate(cm, "1.37.0", strict=True) == "1.37"
