"""Every module under ``benchmarks/`` imports: a moved or renamed helper fails here.

The benchmarks are scripts (``python benchmarks/<name>.py``), so nothing else
imports them before ``make bench`` does.  One interpreter (a subprocess, so this
process's ``sys.path`` and ``sys.modules`` stay as they are) imports each file
under ``benchmarks/``, the ``_`` helpers and the subpackages included, with the
``sys.path`` the scripts run with: the repository first, then the directory a
script of that folder puts first (``import _restart_runs``, ``from common
import ...``).  One test per module reads its outcome.

A module whose import needs a package of an optional extra that is not
installed here (torchft, the ``bench`` extra ``make bench`` installs) is skipped
with the reason; any other failure is the module's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"

#: Top-level packages of optional extras (pyproject.toml) a benchmark may import, and
#: how to install them.
OPTIONAL = {"torchft": "the 'bench' extra (`make bench` installs it: pip install -e '.[bench]')"}

#: Run in the subprocess: import every module named on stdin, one JSON outcome each.
_IMPORTER = """\
import importlib, json, sys, traceback
repo, dirs, names = json.loads(sys.stdin.read())
sys.path[:0] = [repo]
sys.path.extend(dirs)
out = {}
for name in names:
    try:
        importlib.import_module(name)
        out[name] = {"ok": True}
    except BaseException as e:  # SystemExit at import is a failure too
        missing = e.name if isinstance(e, ModuleNotFoundError) else None
        out[name] = {"ok": False, "missing": missing,
                     "error": "".join(traceback.format_exception(e))[-4000:]}
print(json.dumps(out))
"""


def module_names() -> list[str]:
    """Dotted names of every ``.py`` file under ``benchmarks/``."""
    names = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


@cache
def outcomes() -> dict[str, dict[str, Any]]:
    """Each module's import outcome, from one interpreter."""
    dirs = sorted({str(p.parent) for p in BENCHMARKS.rglob("*.py")})
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTER],
        input=json.dumps([str(REPO), dirs, module_names()]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"the importer itself failed:\n{done.stderr[-4000:]}"
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_benchmark_file_is_found() -> None:
    names = module_names()
    assert "benchmarks.recovery" in names and "benchmarks._restart_runs" in names, names
    assert any(n.startswith("benchmarks._control_plane.") for n in names), names


@pytest.mark.parametrize("name", module_names())
def test_benchmark_module_imports(name: str) -> None:
    outcome = outcomes()[name]
    if outcome["ok"]:
        return
    missing = (outcome["missing"] or "").split(".")[0]
    if missing in OPTIONAL:
        pytest.skip(f"{name} needs {missing}, from {OPTIONAL[missing]}")
    path = name.replace(".", "/") + ".py"
    pytest.fail(
        f"{path} does not import: a helper it names may have moved or been renamed; "
        f"fix the import in {path}.\n{outcome['error']}",
        pytrace=False,
    )
