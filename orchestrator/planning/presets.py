"""Failure models: presets from published figures, and files of one's own.

``llama3``: the interruptions of the Llama 3 405B pre-training run, 16,384 H100
GPUs (2,048 nodes of 8) over 54 days: 466 interruptions, 47 planned and 419
unexpected, counted by root cause in Table 5 of "The Llama 3 Herd of Models"
(Llama Team, AI @ Meta, arXiv:2407.21783, 2024).  Each count becomes a rate per
node per day (count / 54 / 2,048).  The paper gives counts, not repair times
nor how many nodes each event took: those are assumptions, listed in
:data:`LLAMA3_ASSUMPTIONS` and in docs/planning.md.

``llama3-stragglers``: the same plus slow nodes.  Lin et al., "Understanding
Stragglers in Large Model Training Using What-if Analysis" (OSDI '25), found on
ByteDance's training cluster that stragglers are frequent and that many are
not one machine's fault (imbalanced work, pipeline stages, data): swapping the
node does not end those.  The rate, slowdown and length below are assumptions
in the spirit of that finding, not figures from the paper.

A file (YAML or JSON) gives sources of one's own::

    name: my-cluster
    sources:
      - {name: gpu, kind: crash, per_node_day: 0.003, repair: 24h}
      - {name: rack switch, kind: crash, per_node_day: 0.0002, nodes: 4, repair: 8h}
      - {name: slow host, kind: straggler, per_node_day: 0.01, slowdown: 1.5, duration: 30m}
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from orchestrator.planning.api import FailureModel, FailureSource, FaultKind, PlanError

__all__ = ["LLAMA3_ASSUMPTIONS", "PRESETS", "failure_model", "load_failure_model"]

_LLAMA3 = "Llama 3 paper (arXiv:2407.21783), Table 5: 54 days, 16,384 GPUs"
_DAYS, _NODES = 54.0, 2048.0
_HOUR = 3600.0

#: Table 5's unexpected interruptions: (root cause, count, kind, nodes per event, repair s).
_LLAMA3_COUNTS: tuple[tuple[str, int, FaultKind, int, float], ...] = (
    ("faulty GPU", 148, FaultKind.CRASH, 1, 24 * _HOUR),
    ("GPU HBM3 memory", 72, FaultKind.CRASH, 1, 24 * _HOUR),
    ("software bug", 54, FaultKind.SOFTWARE, 0, 0.0),
    ("network switch/cable", 35, FaultKind.CRASH, 4, 8 * _HOUR),
    ("host maintenance (unplanned)", 32, FaultKind.PREEMPTION, 1, 4 * _HOUR),
    ("GPU SRAM memory", 19, FaultKind.CRASH, 1, 24 * _HOUR),
    ("GPU system processor", 17, FaultKind.CRASH, 1, 24 * _HOUR),
    ("NIC", 7, FaultKind.CRASH, 1, 24 * _HOUR),
    ("NCCL watchdog timeouts", 7, FaultKind.HANG, 1, 1 * _HOUR),
    ("silent data corruption", 6, FaultKind.CRASH, 1, 24 * _HOUR),
    ("GPU thermal interface + sensor", 6, FaultKind.CRASH, 1, 24 * _HOUR),
    ("SSD", 3, FaultKind.CRASH, 1, 24 * _HOUR),
    ("power supply", 3, FaultKind.CRASH, 1, 24 * _HOUR),
    ("server chassis", 2, FaultKind.CRASH, 1, 24 * _HOUR),
    ("IO expansion board", 2, FaultKind.CRASH, 1, 24 * _HOUR),
    ("dependency", 2, FaultKind.SOFTWARE, 0, 0.0),
    ("CPU", 2, FaultKind.CRASH, 1, 24 * _HOUR),
    ("system memory", 2, FaultKind.CRASH, 1, 24 * _HOUR),
)

LLAMA3_ASSUMPTIONS = (
    "rates: each root cause's count / 54 days / 2,048 nodes; 419 interruptions in all",
    "a hardware fault takes its node for 24 h (repair or replacement); the paper gives no "
    "repair times",
    "a network switch/cable interruption takes 4 nodes at once, back after 8 h (the paper "
    "does not say how many nodes each took)",
    "unplanned host maintenance is a departure with notice (a preemption), back after 4 h",
    "an NCCL watchdog timeout is a hang of one node, back after 1 h",
    "a software bug or a dependency fails every rank at once: a restart from the last "
    "checkpoint in every tier",
)

_STRAGGLERS = (
    FailureSource(
        "slow node (hardware, thermal, a noisy neighbour)",
        FaultKind.STRAGGLER,
        per_node_day=0.01,
        slowdown=1.5,
        duration_s=2 * _HOUR,
        swappable=True,
        citation="assumed; OSDI '25 straggler study (Lin et al.) for the kind",
    ),
    FailureSource(
        "slow work (imbalanced stages or sequence lengths)",
        FaultKind.STRAGGLER,
        per_node_day=0.01,
        slowdown=1.3,
        duration_s=2 * _HOUR,
        swappable=False,
        citation="assumed; OSDI '25 straggler study (Lin et al.): many stragglers are not "
        "one machine's fault",
    ),
)


def _llama3() -> tuple[FailureSource, ...]:
    return tuple(
        FailureSource(
            name,
            kind,
            per_node_day=count / _DAYS / _NODES,
            nodes=nodes,
            repair_s=repair,
            citation=f"{_LLAMA3}: {count} interruptions",
        )
        for name, count, kind, nodes, repair in _LLAMA3_COUNTS
    )


PRESETS: dict[str, FailureModel] = {
    "llama3": FailureModel("llama3", _llama3(), _LLAMA3, LLAMA3_ASSUMPTIONS),
    "llama3-stragglers": FailureModel(
        "llama3-stragglers",
        _llama3() + _STRAGGLERS,
        f"{_LLAMA3}; stragglers: OSDI '25 (Lin et al.), rates assumed",
        (
            *LLAMA3_ASSUMPTIONS,
            "stragglers (assumed): 0.01 slow nodes per node-day at 1.5x and 0.01 slow-work "
            "episodes at 1.3x, 2 h each; only the slow nodes end with a swap",
        ),
    ),
    "none": FailureModel("none", (), "no failures"),
}


def failure_model(name_or_file: str) -> FailureModel:
    """A preset by name, or a failure model file (YAML or JSON)."""
    if name_or_file in PRESETS:
        return PRESETS[name_or_file]
    path = Path(name_or_file)
    if not path.exists():
        raise PlanError(
            f"--failure-model {name_or_file!r}: no preset of that name and no such file "
            f"(presets: {', '.join(PRESETS)}; or give a YAML/JSON file, see docs/planning.md)"
        )
    return load_failure_model(path)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def load_failure_model(path: Path) -> FailureModel:
    """Read a failure model file; every problem names the file, the field and the fix."""
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        raise PlanError(f"{path}: cannot read the failure model: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("sources"), list):
        raise PlanError(
            f"{path}: a failure model is a mapping with a 'sources' list "
            "(each {name, kind, per_node_day, ...}); see docs/planning.md"
        )
    known = {"name", "sources", "citation"}
    if extra := sorted(set(data) - known):
        raise PlanError(f"{path}: unknown key(s) {extra}; known keys: {sorted(known)}")
    sources = tuple(_source(path, i, s) for i, s in enumerate(data["sources"]))
    return FailureModel(str(data.get("name") or path.stem), sources, str(data.get("citation", "")))


def _source(path: Path, i: int, raw: Any) -> FailureSource:
    where = f"{path}: sources[{i}]"
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: expected a mapping with name, kind and per_node_day")
    fields = {"name", "kind", "per_node_day", "nodes", "repair", "slowdown", "duration"}
    fields |= {"swappable", "citation"}
    if extra := sorted(set(raw) - fields):
        raise PlanError(f"{where}: unknown key(s) {extra}; known keys: {sorted(fields)}")
    kinds = ", ".join(k.value for k in FaultKind)
    try:
        kind = FaultKind(str(raw.get("kind")))
    except ValueError:
        raise PlanError(f"{where}.kind: {raw.get('kind')!r} is not one of {kinds}") from None
    rate = _number(where, "per_node_day", raw.get("per_node_day"), minimum=0.0)
    nodes = int(_number(where, "nodes", raw.get("nodes", 1), minimum=1.0))
    slowdown = _number(where, "slowdown", raw.get("slowdown", 1.0), minimum=1.0)
    if kind is FaultKind.STRAGGLER and slowdown <= 1.0:
        raise PlanError(f"{where}.slowdown: a straggler needs a slowdown above 1 (e.g. 1.5)")
    return FailureSource(
        name=str(raw.get("name") or f"source {i}"),
        kind=kind,
        per_node_day=rate,
        nodes=nodes,
        repair_s=_seconds(where, "repair", raw.get("repair", "6h")),
        slowdown=slowdown,
        duration_s=_seconds(where, "duration", raw.get("duration", "0s")),
        swappable=bool(raw.get("swappable", True)),
        citation=str(raw.get("citation", "")),
    )


def _number(where: str, name: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise PlanError(f"{where}.{name}: {value!r} is not a number of at least {minimum:g}")
    return float(value)


def _seconds(where: str, name: str, value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    match = _DURATION.match(str(value))
    if match is None:
        raise PlanError(
            f"{where}.{name}: {value!r} is not a duration (seconds, or e.g. 500ms, 30s, 5m, 8h, 2d)"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]
