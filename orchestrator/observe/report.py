"""``ringmaster report``: one HTML file (and a PNG) that tells a job's story.

:func:`build_report` gathers the job from etcd into a :class:`ReportData`:
the sampled history (loss, throughput), markers for failures, recoveries and
checkpoints on the same time axis (seconds since submission), the recovery
records with their phase timings, and where the wall time went (start-up,
productive, failures, checkpoint stalls: :mod:`orchestrator.observe.training_time`)
with the effective training time.
:func:`render_png` draws it with matplotlib (Agg, no display needed);
:func:`render_html` writes a self-contained page with the PNG embedded as
base64, so the report is a single file to attach to an incident.
"""

from __future__ import annotations

import base64
import html
import io
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.api import JobNotFoundError
from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.history import read_history
from orchestrator.observe.job_observer import outer_loop_text
from orchestrator.observe.records import PHASES, HistorySample, RecoveryRecord
from orchestrator.observe.training_time import (
    PART_LABELS,
    effective_summary,
    effective_text,
    seconds_text,
    time_parts,
    time_rows,
)
from orchestrator.state import events, keys, records
from orchestrator.state.jobs import read_status
from orchestrator.state.records import JobStatus
from orchestrator.state.runs import list_runs

FAILURE, RECOVERY, CHECKPOINT, RUN = "failure", "recovery", "checkpoint", "run"
_COLORS = {FAILURE: "#d62728", RECOVERY: "#2ca02c", CHECKPOINT: "#1f77b4", RUN: "#7f7f7f"}


@dataclass
class Marker:
    """Something that happened at ``time`` seconds after the job was submitted."""

    time: float
    kind: str  # FAILURE, RECOVERY, CHECKPOINT or RUN
    label: str


@dataclass
class ReportData:
    """Everything a report shows; times are seconds since ``t0`` (submission)."""

    job: str
    status: JobStatus
    t0: float
    samples: list[HistorySample] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    recoveries: list[RecoveryRecord] = field(default_factory=list)
    events: list[events.Event] = field(default_factory=list)
    generated_at: float = field(default_factory=time.time)

    @property
    def wall_s(self) -> float:
        end = self.status.finished_at or self.status.updated_at or self.generated_at
        return max(0.0, end - self.t0)

    def throughput(self) -> list[tuple[float, float, float | None]]:
        """``(seconds, steps/s, samples/s)`` between consecutive samples.

        The controller's own rate is a trailing average; differences of
        consecutive samples show a recovery's dip where it happened.
        """
        out: list[tuple[float, float, float | None]] = []
        for a, b in zip(self.samples, self.samples[1:], strict=False):
            dt = b.time - a.time
            if dt <= 0:
                continue
            rate = max(0, b.step - a.step) / dt
            per_step = (
                b.samples_per_s / b.steps_per_s
                if b.samples_per_s is not None and b.steps_per_s > 0
                else None
            )
            out.append((b.time - self.t0, rate, None if per_step is None else rate * per_step))
        return out

    def markers_of(self, kind: str) -> list[Marker]:
        return [m for m in self.markers if m.kind == kind]


def build_report(client: EtcdClient, job: str) -> ReportData:
    """Read ``job``'s status, history, events and recoveries from etcd.

    Raises:
        JobNotFoundError: no job of that name.
    """
    status = read_status(client, job)
    if status is None:
        raise JobNotFoundError(f"no job named '{job}' (see `ringmaster status` for all jobs)")
    recoveries = list(records.read_all(client, keys.job_recoveries(job), RecoveryRecord).values())
    log = events.list_events(client, job)
    runs = list_runs(client, job)
    # the whole story, across runs: time 0 is the first run's submission
    first = runs[0].submitted_at if runs else status.submitted_at
    t0 = first or (log[0].time if log else time.time())
    data = ReportData(job, status, t0, read_history(client, job), [], recoveries, log)
    for run in runs[1:] if len(runs) > 1 else []:
        label = f"run {run.run} submitted"
        if run.resume is not None:
            label += f", resumed from the checkpoint of step {run.resume.step} ({run.resume.url})"
        data.markers.append(Marker(run.submitted_at - t0, RUN, label))
    for r in recoveries:
        nodes = ", ".join(r.nodes) or "-"
        data.markers.append(Marker(r.failure_at - t0, FAILURE, f"{r.cause}: {nodes}"))
        data.markers.append(
            Marker(r.first_step_at - t0, RECOVERY, f"generation {r.generation} ({r.total_s:.2f}s)")
        )
    covered = {n for r in recoveries for n in r.nodes}
    for ev in log:
        if ev.type == "NodeFailed" and ev.data.get("node") not in covered:
            data.markers.append(Marker(ev.time - t0, FAILURE, ev.message))
        elif ev.type == "Checkpoint":
            data.markers.append(Marker(ev.time - t0, CHECKPOINT, f"step {ev.data.get('step')}"))
    data.markers.sort(key=lambda m: m.time)
    return data


def render_png(data: ReportData) -> bytes:
    """Loss and throughput over time with the markers, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_rate) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    try:
        xs = [s.time - data.t0 for s in data.samples]
        losses = [(x, s.loss) for x, s in zip(xs, data.samples, strict=True) if s.loss is not None]
        if losses:
            ax_loss.plot([x for x, _ in losses], [v for _, v in losses], color="#333333", lw=1.2)
        else:
            ax_loss.text(0.5, 0.5, "no loss reported", ha="center", transform=ax_loss.transAxes)
        ax_loss.set_ylabel("loss (rank 0)")
        flow = data.throughput()
        ax_rate.plot([x for x, _, _ in flow], [r for _, r, _ in flow], color="#9467bd", lw=1.2)
        ax_rate.set_ylabel("steps/s", color="#9467bd")
        ax_rate.set_xlabel("seconds since submission")
        per_sample = [(x, v) for x, _, v in flow if v is not None]
        if per_sample:
            twin = ax_rate.twinx()
            twin.plot(
                [x for x, _ in per_sample],
                [v for _, v in per_sample],
                color="#ff7f0e",
                lw=0.8,
                alpha=0.7,
            )
            twin.set_ylabel("samples/s", color="#ff7f0e")
            twin.set_ylim(bottom=0)
        ax_rate.set_ylim(bottom=0)
        for r in data.recoveries:
            for ax in (ax_loss, ax_rate):
                ax.axvspan(
                    r.failure_at - data.t0, r.first_step_at - data.t0, color="#d62728", alpha=0.12
                )
        seen: set[str] = set()
        for m in data.markers:
            style = ":" if m.kind == CHECKPOINT else "--"
            for ax in (ax_loss, ax_rate):
                ax.axvline(
                    m.time,
                    color=_COLORS[m.kind],
                    ls=style,
                    lw=1.0,
                    label=m.kind if m.kind not in seen and ax is ax_loss else None,
                )
            seen.add(m.kind)
        if seen:
            ax_loss.legend(loc="upper right", fontsize=8)
        ax_loss.set_title(
            f"{data.job}: {data.status.phase.value} at step {data.status.step}, "
            f"{len(data.recoveries)} recover{'y' if len(data.recoveries) == 1 else 'ies'}\n"
            + title_time(data.status),
            fontsize=10,
        )
        for ax in (ax_loss, ax_rate):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        return buf.getvalue()
    finally:
        plt.close(fig)


def title_time(s: JobStatus) -> str:
    """The plot's second title line: effective training, and what the rest went to."""
    if s.training_time is None or s.train_started_at is None:
        return f"effective training {s.effective_fraction:.0%}"
    return effective_summary(s.training_time)


def _time_html(s: JobStatus) -> str:
    """Where the run's wall time went, part by part (none before the first step)."""
    split = s.training_time
    if split is None or s.train_started_at is None or split.wall_s <= 0:
        return ""
    parts = "".join(
        f'<tr class="part" data-part="{part}" data-seconds="{seconds:.3f}">'
        f"<th>{PART_LABELS[part]}</th>"
        f"<td>{seconds_text(seconds)}</td><td>{seconds / split.wall_s:.1%}</td></tr>"
        for part, seconds in time_parts(split).items()
    )
    return (
        f'<h2>Where the wall time went</h2>\n<table class="time" data-wall="{split.wall_s:.3f}" '
        f'data-effective="{split.effective:.4f}" data-whole-run="{split.whole_run:.4f}">'
        f"<tr><th>part</th><th>seconds</th><th>share</th></tr>{parts}</table>\n"
        "<p>Effective training is the productive time over the wall time since the first "
        f"completed step: {html.escape(effective_text(split))}.</p>"
    )


def render_html(data: ReportData, png: bytes) -> str:
    """A self-contained HTML page (the PNG is embedded)."""
    e = html.escape
    s = data.status
    image = base64.b64encode(png).decode()
    summary = [
        ("phase", s.phase.value),
        ("step", str(s.step)),
        ("world size", str(s.world_size)),
        ("recoveries", str(len(data.recoveries))),
        ("wall time", f"{data.wall_s:.1f}s"),
        *(
            time_rows(s.training_time)
            if s.training_time is not None and s.train_started_at is not None
            else [
                ("productive time", f"{s.productive_s:.1f}s"),
                ("effective training", f"{s.effective_fraction:.1%}"),
            ]
        ),
        ("last checkpoint", s.last_checkpoint or "-"),
    ]
    if s.sync:
        summary.append(("outer loop", outer_loop_text(s.sync)))
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary)
    time_table = _time_html(s)
    head = "".join(f"<th>{p.replace('_', ' ')} (s)</th>" for p in PHASES)
    rec_rows = []
    for r in data.recoveries:
        phases = r.phases
        cells = "".join(f'<td class="phase-{p}">{phases[p]:.3f}</td>' for p in PHASES)
        rec_rows.append(
            f'<tr class="recovery" data-generation="{r.generation}" data-cause="{e(r.cause)}" '
            f'data-total="{r.total_s:.6f}" data-source="{e(r.source)}" '
            f'data-steps-lost="{r.steps_lost if r.source else ""}">'
            f"<td>{r.failure_at - data.t0:.2f}</td><td>{r.generation}</td><td>{e(r.cause)}</td>"
            f"<td>{e(', '.join(r.nodes))}</td>{cells}<td>{r.total_s:.3f}</td>"
            f"<td>{r.steps_rerun}</td><td>{e(r.source or '-')}</td>"
            f"<td>{r.steps_lost if r.source else '-'}</td></tr>"
        )
    recoveries = (
        '<table class="recoveries"><tr><th>at (s)</th><th>generation</th><th>cause</th>'
        f"<th>nodes</th>{head}<th>total (s)</th><th>steps re-run</th>"
        "<th>state from</th><th>steps lost</th></tr>"
        + ("".join(rec_rows) or '<tr><td colspan="12">no recoveries</td></tr>')
        + "</table>"
    )
    marker_rows = "".join(
        f'<tr class="marker marker-{m.kind}" data-time="{m.time:.3f}">'
        f"<td>{m.time:.2f}</td><td>{m.kind}</td><td>{e(m.label)}</td></tr>"
        for m in data.markers
    )
    event_rows = "".join(
        f"<tr><td>{ev.time - data.t0:.2f}</td><td>{e(ev.type)}</td><td>{e(ev.message)}</td></tr>"
        for ev in data.events
    )
    generated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data.generated_at))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ringmaster report: {e(data.job)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: left; font-size: 14px; }}
tr.marker-failure td, tr.recovery td {{ color: #b22; }}
tr.marker-recovery td {{ color: #282; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>Job {e(data.job)}</h1>
<p>Generated {generated}; times are seconds since the job was submitted.</p>
<table class="summary">{rows}</table>
{time_table}
<img alt="loss and throughput over time" src="data:image/png;base64,{image}">
<h2>Recoveries</h2>
{recoveries}
<h2>Failures, recoveries and checkpoints</h2>
<table class="markers"><tr><th>at (s)</th><th>kind</th><th>what</th></tr>{marker_rows}</table>
<h2>Events</h2>
<table class="events"><tr><th>at (s)</th><th>type</th><th>message</th></tr>{event_rows}</table>
</body></html>
"""


def write_report(
    client: EtcdClient, job: str, html_path: str | Path, png_path: str | Path | None = None
) -> tuple[Path, Path, ReportData]:
    """Write the HTML report and the PNG beside it (``report.png`` for ``report.html``).

    Raises:
        JobNotFoundError: no job of that name.
    """
    html_out = Path(html_path)
    png_out = Path(png_path) if png_path is not None else html_out.with_suffix(".png")
    data = build_report(client, job)
    png = render_png(data)
    html_out.parent.mkdir(parents=True, exist_ok=True)
    png_out.parent.mkdir(parents=True, exist_ok=True)
    png_out.write_bytes(png)
    html_out.write_text(render_html(data, png))
    return html_out, png_out, data
