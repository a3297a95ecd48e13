"""A plan in words, as a PNG and as one HTML page (inline SVG, nothing to fetch)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from orchestrator.planning.api import LOSS_CAUSES, SimResult
from orchestrator.planning.plan import Plan
from orchestrator.planning.raster import line_chart_png

__all__ = ["SPARE_RULE", "plan_lines", "render_html", "render_png", "write_report"]

SPARE_RULE = (
    "spares: the count that maximises work per GPU reserved, ETTR x N / (N + spares); "
    "cadence: Young/Daly sqrt(2 x C x MTBF) (C: seconds a save blocks training, MTBF: "
    "between faults that send the job back to its checkpoint), then the best of the "
    "multiples 0.25-4x of it the simulator tried"
)


def _pct(x: float) -> str:
    return f"{x * 100:.2f} %"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"


def plan_lines(plan: Plan) -> list[str]:
    """The plan as lines of text (what ``ringmaster plan`` prints)."""
    job, rec = plan.job, plan.recommendation
    mtbf = "none" if rec.mtbf_s == float("inf") else _duration(rec.mtbf_s)
    lines = [
        f"job: {job.nodes} nodes x {job.gpus_per_node} GPUs ({job.gpus:,} GPUs), nodes.min "
        f"{job.floor}, step {job.step_s:g} s, {job.state_gb:g} GB of state per node",
        f"failure model: {plan.failures.name} ({plan.failures.per_node_day() * job.nodes:.2f} "
        f"faults per day at this size); simulated {plan.horizon_s / 86400:g} days",
        f"tier: {rec.tier.value}",
        f"recommended spares: {rec.spares}",
        f"recommended checkpoint cadence: every {_duration(rec.cadence_s)} of training "
        f"(Young/Daly: {_duration(rec.young_daly_s)}, MTBF of faults that lose work: {mtbf})",
        f"expected ETTR: {_pct(rec.ettr)} with {rec.spares} spares, "
        f"{_pct(rec.ettr_without_spares)} without",
        f"rule: {SPARE_RULE}",
        "",
        "every tier, same faults, same spares, each at its own Young/Daly cadence:",
    ]
    for tier, result in plan.tiers.items():
        lost = ", ".join(
            f"{cause} {result.lost_gpu_h[cause] / result.days:,.0f}"
            for cause in LOSS_CAUSES
            if result.lost_gpu_h[cause] >= 0.5
        )
        lines.append(
            f"  {tier.value:<22} ETTR {_pct(result.ettr):>8}  GPU-h lost/day "
            f"{result.lost_gpu_h_per_day:>10,.0f}  ({lost or 'none'}); spares ran out "
            f"{result.exhaustions}x"
        )
    lines += ["", "assumptions:"]
    lines += [f"  - {a}" for a in (*plan.failures.assumptions, *plan.recovery.notes)]
    return lines


def _panels(plan: Plan) -> list[tuple[str, str, list[tuple[float, float]], float | None]]:
    rec = plan.recommendation
    return [
        ("ETTR BY SPARES", "SPARES", [(s, e) for s, e, _ in rec.spare_curve], rec.spares),
        (
            "ETTR BY CHECKPOINT CADENCE",
            "MINUTES",
            [(c / 60, e) for c, e in rec.cadence_curve],
            rec.cadence_s / 60,
        ),
    ]


def render_png(plan: Plan) -> bytes:
    """ETTR against spares and against cadence, side by side."""
    return line_chart_png(_panels(plan))


def _svg_chart(points: Sequence[tuple[float, float]], marked: float | None, xlabel: str) -> str:
    w, h, left, bottom, top, right = 440, 260, 60, 220, 20, 420
    if not points:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1e-9)
    y0, y1 = min(ys), max(max(ys), min(ys) + 1e-4)

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            left + (x - x0) / (x1 - x0) * (right - left),
            bottom - (y - y0) / (y1 - y0) * (bottom - top),
        )

    path = " ".join(f"{px:.1f},{py:.1f}" for px, py in (at(x, y) for x, y in points))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="11">',
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#333"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#333"/>',
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{path}"/>',
        f'<text x="2" y="{top + 4}">{y1 * 100:.2f}%</text>',
        f'<text x="2" y="{bottom}">{y0 * 100:.2f}%</text>',
        f'<text x="{left}" y="{bottom + 16}">{x0:g}</text>',
        f'<text x="{right - 30}" y="{bottom + 16}">{x1:.4g}</text>',
        f'<text x="{(left + right) // 2 - 20}" y="{bottom + 34}">{html.escape(xlabel)}</text>',
    ]
    for x, y in points:
        px, py = at(x, y)
        parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="#1f77b4"/>')
    if marked is not None:
        px, _ = at(marked, y0)
        parts.append(
            f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{bottom}" stroke="#d62728"/>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _size_chart(result: SimResult) -> str:
    """The job's size over time (nodes training; 0 while stopped), as an SVG step line."""
    w, h, left, right, top, bottom = 900, 160, 50, 880, 10, 130
    n, horizon = result.job.nodes, result.horizon_s
    points, last = [], n
    for t, size in result.sizes:
        x = left + t / horizon * (right - left)
        points += [(x, last), (x, size)]
        last = size
    points.append((right, last))
    coords = " ".join(f"{x:.1f},{bottom - s / max(1, n) * (bottom - top):.1f}" for x, s in points)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="11">'
        f'<polyline fill="none" stroke="#2ca02c" points="{coords}"/>'
        f'<text x="2" y="{top + 8}">{n}</text><text x="2" y="{bottom}">0</text>'
        f'<text x="{left}" y="{bottom + 20}">0</text>'
        f'<text x="{right - 40}" y="{bottom + 20}">{horizon / 86400:g} days</text></svg>'
    )


def render_html(plan: Plan) -> str:
    """One self-contained page: the plan, its two curves, every tier, the job's size."""
    rec = plan.recommendation
    (t1, x1, p1, m1), (t2, x2, p2, m2) = _panels(plan)
    rows = "".join(
        f"<tr><td>{tier.value}</td><td>{_pct(r.ettr)}</td><td>{r.lost_gpu_h_per_day:,.0f}</td>"
        + "".join(f"<td>{r.lost_gpu_h[c] / r.days:,.0f}</td>" for c in LOSS_CAUSES)
        + f"<td>{r.exhaustions}</td></tr>"
        for tier, r in plan.tiers.items()
    )
    heads = "".join(f"<th>{c}</th>" for c in LOSS_CAUSES)
    text = "\n".join(plan_lines(plan))
    size = _size_chart(rec.result) if rec.result is not None else ""
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>ringmaster plan</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:right}"
        "pre{background:#f6f6f6;padding:1em;white-space:pre-wrap}</style></head><body>"
        f"<h1>Plan: {plan.job.gpus:,} GPUs, {html.escape(plan.failures.name)}</h1>"
        f"<pre>{html.escape(text)}</pre>"
        f"<h2>{t1.lower()}</h2>{_svg_chart(p1, m1, x1.lower())}"
        f"<h2>{t2.lower()}</h2>{_svg_chart(p2, m2, x2.lower())}"
        "<h2>Every tier: GPU-hours lost per day, by cause</h2>"
        f"<table><tr><th>tier</th><th>ETTR</th><th>lost/day</th>{heads}"
        f"<th>spares ran out</th></tr>{rows}</table>"
        f"<h2>Nodes training over time ({rec.tier.value}, one run)</h2>{size}"
        "</body></html>"
    )


def write_report(plan: Plan, out: Path) -> tuple[Path, Path]:
    """Write ``plan.png`` and ``plan.html`` into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    png, page = out / "plan.png", out / "plan.html"
    png.write_bytes(render_png(plan))
    page.write_text(render_html(plan), encoding="utf-8")
    return png, page
