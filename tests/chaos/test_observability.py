"""Observability of a real local run with one injected failure.

One module-scoped run (etcd, a controller serving metrics, three node agents
as processes; a whole node SIGKILLed at step 60) is shared by every test:
the metrics endpoint is scraped while the job trains and after it finished,
the recovery record is checked against the workers' own step logs, and the
CLI (`status`, `events`, `report`) is run against the run's etcd.
"""

from __future__ import annotations

import io
import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from orchestrator.api import JobPhase
from orchestrator.cli import main
from orchestrator.cli.local_commands import time_table
from orchestrator.local_run import LocalRun, RunResult
from orchestrator.observe.records import PHASES, RecoveryRecord
from orchestrator.observe.report import CHECKPOINT, FAILURE, RECOVERY, build_report
from orchestrator.observe.training_time import PARTS, seconds_text, time_parts
from orchestrator.state import jobs, keys
from tests.chaos.jobs import quiet_run, step_log, summary, tiny_job

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS, KILL_AT, SCRAPE_AT = 150, 60, 25
#: How much later than the last worker's first step the controller may notice it
#: (its loop period, the heartbeat that carries the step, a busy machine).
OBSERVE_SLACK_S = 2.0

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text format → {(name, labels): value}."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(
    metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    if "job" in labels:  # the job's label is `ringmaster_job` (Prometheus owns `job`)
        labels["ringmaster_job"] = labels.pop("job")
    want = frozenset(labels.items())
    found = [v for (n, ls), v in metrics.items() if n == name and want <= ls]
    assert found, f"no sample {name}{labels}; have {sorted({n for n, _ in metrics})}"
    return sum(found)


@dataclass
class Observed:
    run: LocalRun
    result: RunResult
    lines: list[str]
    tmp: Path
    mid: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)
    end: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)

    @property
    def etcd(self) -> str:
        assert self.run.etcd_options is not None
        return ",".join(self.run.etcd_options.endpoints)

    def cli(self, *args: str) -> str:
        res = CliRunner().invoke(main, [*args, "--etcd", self.etcd], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return res.output


def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return parse_metrics(resp.read().decode())


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observed")
    spec = tiny_job("observed", tmp, steps=STEPS)
    spec.checkpoint.every_steps = 50
    lines: list[str] = []
    mid: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}

    with quiet_run(spec, lines, kill_node_at_step=KILL_AT) as run:

        def scrape_mid_run() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                status = jobs.read_status(run._client, spec.name) if run._client else None
                if run.metrics_url and status and status.step >= SCRAPE_AT:
                    mid.update(_scrape(run.metrics_url))
                    return
                time.sleep(0.05)

        scraper = threading.Thread(target=scrape_mid_run, daemon=True)
        scraper.start()
        result = run.wait()
        scraper.join(timeout=10)
        assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
        assert result.metrics_url is not None, summary(result, lines)
        obs = Observed(run, result, lines, tmp, mid=mid, end=_scrape(result.metrics_url))
        yield obs


def test_run_prints_the_metrics_url(observed: Observed) -> None:
    url = observed.result.metrics_url
    assert url is not None and re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
    assert f"[run] metrics at {url}" in observed.lines


def test_metrics_while_training(observed: Observed) -> None:
    m = observed.mid
    assert m, "the endpoint was never scraped while the job trained"
    job = "observed"
    assert value(m, "ringmaster_job_phase", job=job, phase="Running") == 1
    assert value(m, "ringmaster_job_phase", job=job, phase="Pending") == 0
    assert SCRAPE_AT <= value(m, "ringmaster_job_step", job=job) <= STEPS
    rate = value(m, "ringmaster_job_steps_per_second", job=job)
    assert rate > 0
    # each step is one global batch of 64 samples (examples/train_tiny.py)
    assert value(m, "ringmaster_job_samples_per_second", job=job) == pytest.approx(
        64 * rate, rel=0.01
    )
    assert value(m, "ringmaster_job_world_size", job=job) == 2
    assert value(m, "ringmaster_job_spare_nodes", job=job) == 1
    assert value(m, "ringmaster_job_nodes", job=job, state="active") == 2
    assert value(m, "ringmaster_job_comm_wire_bytes_total", job=job) > 0
    assert value(m, "ringmaster_job_comm_compression_ratio", job=job) == 1.0  # no compression
    assert 0 < value(m, "ringmaster_job_effective_training_ratio", job=job) <= 1


def test_metrics_after_the_failure(observed: Observed) -> None:
    m = observed.end
    job = "observed"
    assert value(m, "ringmaster_job_phase", job=job, phase="Succeeded") == 1
    assert value(m, "ringmaster_job_step", job=job) == STEPS
    assert value(m, "ringmaster_job_recoveries_total", job=job) == 1
    assert value(m, "ringmaster_job_recoveries_total", job=job, cause="agent_gone") == 1
    assert value(m, "ringmaster_job_nodes", job=job, state="failed") == 1
    assert value(m, "ringmaster_job_spare_nodes", job=job) == 0
    assert value(m, "ringmaster_job_recovery_seconds_count", job=job) == 1
    total = value(m, "ringmaster_job_recovery_seconds_sum", job=job)
    phases = [
        value(m, "ringmaster_job_last_recovery_phase_seconds", job=job, phase=p) for p in PHASES
    ]
    assert all(p >= 0 for p in phases)
    assert sum(phases) == pytest.approx(total, abs=1e-6)
    for p in PHASES:
        assert value(m, "ringmaster_job_recovery_phase_seconds_count", job=job, phase=p) == 1
    # saves at steps 50, 100 and 150, each with its blocking and upload time
    assert value(m, "ringmaster_job_checkpoints_total", job=job) >= 2
    assert value(m, "ringmaster_job_checkpoint_blocking_seconds", job=job) > 0
    assert value(m, "ringmaster_job_checkpoint_upload_seconds", job=job) > 0
    # 2 ranks x (16*32+32 + 32*4+4) fp32 parameters per step; the killed node's last
    # steps before its final heartbeat are never reported, hence the lower margin
    dense = STEPS * 2 * 4 * 676
    assert 0.9 * dense <= value(m, "ringmaster_job_comm_wire_bytes_total", job=job) <= 1.05 * dense


def _record(observed: Observed) -> RecoveryRecord:
    client = observed.run._client
    assert client is not None
    kvs = client.get_prefix(keys.job_recoveries("observed"))
    assert len(kvs) == 1, [kv.key for kv in kvs]
    return RecoveryRecord.from_dict(json.loads(kvs[0].value))


def test_one_recovery_whose_phases_sum_to_the_measured_time(observed: Observed) -> None:
    r = _record(observed)
    assert r.generation == 2
    assert r.nodes == [observed.result.killed_node]
    assert r.cause == "agent_gone"  # SIGKILLed with its agent: the liveness port refused
    assert set(r.phases) == set(PHASES)
    assert all(v >= 0 for v in r.phases.values()), r.phases
    assert sum(r.phases.values()) == pytest.approx(r.total_s, abs=1e-6)
    # the controller's own measurement ends when it saw the job train again
    assert r.total_s <= r.observed_s + 1e-3
    assert r.observed_s - r.total_s < OBSERVE_SLACK_S, (r.observed_s, r.total_s)
    # compare with the workers' own step logs: the new generation's first applied step
    firsts = []
    for seq_file in sorted((observed.tmp / "steps").glob("*.log")):
        for line in seq_file.read_text().splitlines():
            step, gen, _rank, at = line.split()[:4]
            if int(gen) == 2:
                firsts.append((float(at), int(step)))
                break
    assert len(firsts) == 2, "both workers of generation 2 logged steps"
    assert max(at for at, _ in firsts) == pytest.approx(r.first_step_at, abs=0.5)
    assert {step for _, step in firsts} == {r.step}  # the failed step ran again, nothing lost
    assert r.steps_rerun == 0
    assert r.failure_at < r.declared_at <= r.group_formed_at <= r.restored_at <= r.first_step_at
    # the spare (the only node whose log starts in generation 2) was part of the new group
    assert any(seq and seq[0] >= KILL_AT for seq in step_log(observed.tmp).values())


def test_events_list_membership_failure_recovery_checkpoint_and_phase(observed: Observed) -> None:
    out = observed.cli("events", "observed", "--json")
    log = [json.loads(line) for line in out.splitlines() if line.strip()]
    kinds = [e["type"] for e in log]
    for kind in ("NodeRegistered", "Generation", "Phase", "NodeFailed", "Recovered", "Checkpoint"):
        assert kind in kinds, kinds
    assert all(isinstance(e["time"], float) for e in log)
    assert [e["time"] for e in log] == sorted(e["time"] for e in log)
    failed = [e for e in log if e["type"] == "NodeFailed"]
    assert [e["data"]["cause"] for e in failed] == ["agent_gone"]
    recovered = next(e for e in log if e["type"] == "Recovered")
    assert set(recovered["data"]["phases"]) == set(PHASES)
    assert kinds.index("NodeFailed") < kinds.index("Recovered")
    table = observed.cli("events", "observed")
    assert "Recovered" in table and "NodeFailed" in table


def test_status_shows_phase_rate_nodes_checkpoint_and_effective_time(observed: Observed) -> None:
    out = observed.cli("status", "observed")
    assert "Succeeded" in out and str(STEPS) in out
    assert "2/0/1" in out  # active/spare/failed
    assert "step 150" in out  # the last checkpoint
    status = jobs.read_status(observed.run._client, "observed")  # type: ignore[arg-type]
    assert status is not None
    assert 0 < status.effective_fraction < 1
    assert f"{status.effective_fraction:.1%} since the first step" in out
    assert status.train_started_at is not None and status.finished_at is not None
    assert status.productive_s < status.finished_at - status.submitted_at


def test_the_wall_time_splits_into_start_up_failures_and_checkpoint_stalls(
    observed: Observed, tmp_path: Path
) -> None:
    """The split adds up to the wall time; the failure line is the recovery's cost
    (the failure to the new generation's first step; no step was trained again),
    the start-up is the submission to the first step; table, status, report and
    metrics say the same."""
    status = jobs.read_status(observed.run._client, "observed")  # type: ignore[arg-type]
    assert status is not None and status.training_time is not None
    t = status.training_time
    assert status.train_started_at is not None and status.finished_at is not None
    ms = 0.01  # the status keeps milliseconds
    assert sum(time_parts(t).values()) == pytest.approx(t.wall_s, abs=ms)
    assert t.wall_s == pytest.approx(status.finished_at - status.submitted_at, abs=ms)
    assert t.startup_s == pytest.approx(status.train_started_at - status.submitted_at, abs=ms)
    r = _record(observed)
    assert r.steps_rerun == 0 and t.rerun_s == 0
    assert t.failures_s == pytest.approx(r.total_s, abs=ms)
    assert t.recovering_s == pytest.approx(r.total_s, abs=ms)
    assert t.checkpoint_s > 0  # the saves at steps 50 and 100 blocked the loop
    assert t.effective == status.effective_fraction
    assert t.productive_s == status.productive_s
    assert t.effective == pytest.approx(t.productive_s / t.since_first_step_s, abs=1e-3)
    # the metrics: the same parts, the same effective training
    m = observed.end
    for part, seconds in time_parts(t).items():
        assert value(m, "ringmaster_job_time_seconds", job="observed", part=part) == (
            pytest.approx(seconds, abs=ms)
        )
    assert value(m, "ringmaster_job_effective_training_ratio", job="observed") == (
        pytest.approx(t.effective, abs=1e-3)
    )
    assert value(m, "ringmaster_job_whole_run_effective_ratio", job="observed") == (
        pytest.approx(t.whole_run, abs=1e-3)
    )
    # the table `ringmaster run` ends with
    assert observed.result.training_time == t
    out = io.StringIO()
    Console(file=out, width=80, force_terminal=False).print(time_table(t))
    cells = " ".join(out.getvalue().split())
    assert seconds_text(t.startup_s) in cells and seconds_text(t.failures_s) in cells
    assert f"{t.effective:.1%}" in cells
    # status and the report
    shown = observed.cli("status", "observed")
    assert "start-up" in shown and "lost to failures" in shown and "checkpoint stalls" in shown
    html_path = tmp_path / "report.html"
    observed.cli("report", "observed", "-o", str(html_path))
    page = html_path.read_text()
    found = dict(re.findall(r'data-part="(\w+)" data-seconds="([\d.]+)"', page))
    assert list(found) == list(PARTS)
    for part, seconds in time_parts(t).items():
        assert float(found[part]) == pytest.approx(seconds, abs=ms)


def test_report_writes_html_and_png_with_failure_and_recovery_marked(
    observed: Observed, tmp_path: Path
) -> None:
    html_path = tmp_path / "report.html"
    out = observed.cli("report", "observed", "-o", str(html_path))
    png_path = tmp_path / "report.png"
    assert "1 recovery" in out
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = html_path.read_text()
    assert "data:image/png;base64," in page
    rows = re.findall(r'<tr class="recovery" data-generation="2" data-cause="agent_gone"', page)
    assert len(rows) == 1
    assert page.count('class="marker marker-failure"') == 1
    assert page.count('class="marker marker-recovery"') == 1
    assert page.count('class="marker marker-checkpoint"') >= 2

    data = build_report(observed.run._client, "observed")  # type: ignore[arg-type]
    (failure,) = data.markers_of(FAILURE)
    (recovery,) = data.markers_of(RECOVERY)
    assert 0 < failure.time < recovery.time < data.wall_s
    assert len(data.markers_of(CHECKPOINT)) >= 2
    assert any(s.loss is not None for s in data.samples)
    assert any(s.steps_per_s > 0 for s in data.samples)
    # the history covers the failure: samples before it and after the recovery
    times = [s.time - data.t0 for s in data.samples]
    assert min(times) < failure.time and max(times) > recovery.time


def test_watch_prints_failures_and_recoveries_then_the_outcome(observed: Observed) -> None:
    out = observed.cli("watch", "observed", "--interval", "0.1")
    assert "[event] NodeFailed:" in out and "(agent_gone)" in out
    assert "[event] Recovered: generation 2 trains again" in out
    assert out.index("NodeFailed") < out.index("Recovered")
    assert "observed: Succeeded at step 150; 1 recovery" in out
