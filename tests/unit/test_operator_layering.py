"""Layering the import contracts cannot see: importing the operator package stays light.

Which modules may import kopf and the Kubernetes client is stated as
import-linter contracts in ``pyproject.toml`` (``make lint`` checks them).
Those count every import, including the lazy one with which
``orchestrator.operator.run_operator`` reaches kopf; this test checks the
other half of that design: importing the package itself loads neither.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_operator_package_loads_neither_kopf_nor_the_client() -> None:
    code = (
        "import sys, orchestrator.operator; "
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
