"""Layering: one module imports the Kubernetes client; the pure parts need no kopf."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
_KUBE_IMPORT = re.compile(r"^\s*(import kubernetes|from kubernetes[\s.])", re.MULTILINE)


def test_only_kube_py_imports_the_kubernetes_client() -> None:
    importers = sorted(
        str(p.relative_to(ROOT))
        for package in ("orchestrator", "agents", "checkpoint")
        for p in (ROOT / package).rglob("*.py")
        if _KUBE_IMPORT.search(p.read_text(encoding="utf-8"))
    )
    assert importers == ["orchestrator/operator/kube.py"]


def test_reconcile_and_crd_import_neither_kopf_nor_the_client() -> None:
    code = (
        "import sys, orchestrator.operator, orchestrator.operator.reconcile, "
        "orchestrator.operator.crd, orchestrator.operator.probe, orchestrator.operator.topology; "
        "print(sorted(m for m in ('kopf', 'kubernetes') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]"
