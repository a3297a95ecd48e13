"""Failure presets, failure model files and the plan's PNG."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from orchestrator.planning.api import FaultKind, PlanError
from orchestrator.planning.presets import PRESETS, failure_model, load_failure_model
from orchestrator.planning.raster import line_chart_png

pytestmark = pytest.mark.unit


def test_llama3_preset_holds_the_papers_419_interruptions() -> None:
    model = PRESETS["llama3"]
    per_run = model.per_node_day() * 54 * 2048
    assert per_run == pytest.approx(419)
    software = model.per_node_day((FaultKind.SOFTWARE,)) * 54 * 2048
    assert software == pytest.approx(56)  # software bug 54 + dependency 2
    assert all(s.citation.startswith("Llama 3 paper") for s in model.sources)


def test_a_failure_model_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "name: mine\nsources:\n"
        "  - {name: gpu, kind: crash, per_node_day: 0.01, repair: 8h}\n"
        "  - {name: rack, kind: crash, per_node_day: 0.001, nodes: 4, repair: 30m}\n"
        "  - {name: slow, kind: straggler, per_node_day: 0.02, slowdown: 1.5, duration: 2h}\n"
    )
    model = failure_model(str(path))
    assert model.name == "mine"
    assert [s.repair_s for s in model.sources] == [8 * 3600, 1800, 6 * 3600]
    assert model.sources[1].nodes == 4
    assert model.sources[2].duration_s == 7200


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("sources:\n  - {name: g, kind: crsh, per_node_day: 1}\n", "sources[0].kind: 'crsh'"),
        ("sources:\n  - {name: g, kind: crash, per_node_day: -1}\n", "sources[0].per_node_day"),
        ("sources:\n  - {kind: crash, per_node_day: 1, repair: soon}\n", "sources[0].repair"),
        ("sources:\n  - {kind: crash, per_node_day: 1, rate: 2}\n", "unknown key(s) ['rate']"),
        ("name: x\n", "a 'sources' list"),
    ],
)
def test_a_bad_failure_model_file_names_the_field(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PlanError) as e:
        load_failure_model(path)
    assert str(path) in str(e.value) and says in str(e.value)


def test_an_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(PlanError, match="presets: llama3, llama3-stragglers, none"):
        failure_model("llama4")


def test_the_png_is_a_png() -> None:
    data = line_chart_png([("ETTR", "SPARES", [(0, 0.9), (1, 0.95), (2, 0.96)], 1.0)], 300, 200)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (300, 200)
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4 : idat])[0]
    raw = zlib.decompress(data[idat + 4 : idat + 4 + length])
    assert len(raw) == height * (1 + width * 3)
    assert raw.count(b"\x1f\x77\xb4") > 50  # the curve's blue
