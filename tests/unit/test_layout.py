"""The product's shape, checked: no import cycles; long modules listed, not refused.

Among the modules of ``orchestrator``, ``agents`` and ``checkpoint`` an import
is every ``import`` statement a module holds: at module level, inside a
function, and under ``if TYPE_CHECKING:`` (a reader must follow those too, so a
cycle through them is a cycle in the design).  Any cycle fails the test.

A module's length is a reason to look at it, not a limit: the modules longer
than :data:`LOOK_AT_LINES` are listed at the end of every test run (the
``pytest_terminal_summary`` hook in ``tests/conftest.py``), each with whether
its opening paragraph says why it is whole.  A long module is split where its
concerns part, or left whole with the reason in its docstring.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "agents", "checkpoint")
#: Modules longer than this are listed for a look at the end of a test run.
LOOK_AT_LINES = 450


# --------------------------------------------------------------------------- the checker


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` file under ``packages``."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_modules(module: str, path: Path, modules: Collection[str]) -> set[str]:
    """The ``modules`` that ``module``'s file imports, wherever the statement is.

    ``from pkg import name`` imports ``pkg.name`` when that is a module, else
    ``pkg``; a name outside ``modules`` counts as its longest enclosing module.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in modules else base)
    found: set[str] = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module → the product modules it imports."""
    files = module_files(root, packages)
    return {module: imported_modules(module, path, files) for module, path in files.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected sets of two or more modules (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(frozenset(members))
    return found


def new_cycles(
    graph: Mapping[str, set[str]], known: Iterable[frozenset[str]]
) -> list[frozenset[str]]:
    """Cycles not inside one of the ``known`` sets of modules."""
    known = list(known)
    return [c for c in cycles(graph) if not any(c <= k for k in known)]


def large_modules(root: Path, packages: Iterable[str], limit: int) -> dict[str, int]:
    """Path (from ``root``) → line count of every module longer than ``limit`` lines."""
    out: dict[str, int] = {}
    for path in module_files(root, packages).values():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            out[path.relative_to(root).as_posix()] = lines
    return out


def says_why_long(path: Path, limit: int = LOOK_AT_LINES) -> bool:
    """The module's docstring says why it is long (it names the size it goes past)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return f"{limit} lines" in doc


def long_module_report(
    root: Path = ROOT, packages: Iterable[str] = PACKAGES, limit: int = LOOK_AT_LINES
) -> list[str]:
    """One line per module over ``limit`` lines, longest first."""
    large = large_modules(root, packages, limit)
    return [
        f"{name}: {lines} lines"
        + (
            ""
            if says_why_long(root / name, limit)
            else " (its docstring does not say why it is whole)"
        )
        for name, lines in sorted(large.items(), key=lambda item: -item[1])
    ]


# --------------------------------------------------------------------------- the product


def test_no_new_import_cycle() -> None:
    found = new_cycles(import_graph(ROOT, PACKAGES), ())
    assert not found, "import cycles (TYPE_CHECKING and function-level imports count): " + (
        "; ".join(" <-> ".join(sorted(c)) for c in found)
    )


def test_the_long_module_report_lists_long_modules_longest_first_with_why(
    tmp_path: Path,
) -> None:
    body = "x = 1\n"
    _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/short.py": body,
            "pkg/long.py": '"""A module."""\n' + body * 30,
            "pkg/why.py": '"""A module.\n\nOver 10 lines: one table.\n"""\n' + body * 12,
        },
    )
    assert long_module_report(tmp_path, ["pkg"], 10) == [
        "pkg/long.py: 31 lines (its docstring does not say why it is whole)",
        "pkg/why.py: 16 lines",
    ]


# ---------------------------------------------------------------------- the checker's own tests


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_cycle_through_type_checking_and_function_imports_is_found(tmp_path: Path) -> None:
    _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
            ),
            "pkg/b.py": "def f():\n    from . import c\n",
            "pkg/c.py": "import pkg.a\n",
            "pkg/d.py": "from pkg import a\nfrom .sub.e import E\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/e.py": "from ..c import x\nE = 1\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.d"] == {"pkg.a", "pkg.sub.e"}
    assert graph["pkg.sub.e"] == {"pkg.c"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]
    assert new_cycles(graph, [frozenset({"pkg.a", "pkg.b", "pkg.c", "pkg.d"})]) == []
    # a known cycle among fewer modules does not cover a larger one
    assert new_cycles(graph, [frozenset({"pkg.a", "pkg.b"})]) == cycles(graph)


def test_a_package_without_cycles_passes(tmp_path: Path) -> None:
    _package(tmp_path, {"pkg/__init__.py": "from pkg import a\n", "pkg/a.py": "import os\n"})
    assert cycles(import_graph(tmp_path, ["pkg"])) == []


def test_a_large_module_is_found_and_an_exception_must_say_why(tmp_path: Path) -> None:
    long_body = "x = 1\n" * 20
    _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/short.py": "x = 1\n",
            "pkg/long.py": '"""A module."""\n' + long_body,
            "pkg/why.py": '"""A module.\n\nOver 10 lines: one table.\n"""\n' + long_body,
        },
    )
    assert large_modules(tmp_path, ["pkg"], 10) == {"pkg/long.py": 21, "pkg/why.py": 24}
    assert says_why_long(tmp_path / "pkg/why.py", 10)
    assert not says_why_long(tmp_path / "pkg/long.py", 10)


_IMPORT_EACH = """
import importlib, json, sys
PACKAGES = {"orchestrator", "agents", "checkpoint"}
failed = []
states = {}  # module -> the product modules that importing it first loads (None: it failed)

def fresh_import(name):
    for loaded in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
        return None
    return {m for m in sys.modules if m.split(".")[0] in PACKAGES}

def state(name):
    if name not in states:
        parent = name.rpartition(".")[0]
        above = state(parent) if parent else None
        # Importing a.b.c first imports a.b first; when that alone loads a.b.c, importing
        # a.b.c first runs exactly what importing a.b first runs: nothing more to try.
        states[name] = above if above is not None and name in above else fresh_import(name)
    return states[name]

for name in json.loads(sys.argv[1]):
    state(name)
print("\\n".join(failed))
"""


def test_every_module_imports_on_its_own() -> None:
    """A module imported first, before anything else of the product, imports: a package's
    ``__init__`` that imports its own modules back half-initialised shows only this way
    (the cycle checks above see module-to-module edges, not a package's implicit import).
    A module that its package's ``__init__`` already imports is tried with its package."""
    names = sorted(n for n in module_files(ROOT, PACKAGES) if not n.endswith(".__main__"))
    groups: dict[str, list[str]] = {}
    for name in names:  # a subpackage stays in one interpreter, its packages tried once there
        groups.setdefault(".".join(name.split(".")[:2]), []).append(name)
    halves: list[list[str]] = [[], []]  # two interpreters side by side: one per core
    for group in sorted(groups.values(), key=len, reverse=True):
        min(halves, key=len).extend(group)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _IMPORT_EACH, json.dumps(half)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for half in halves
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert not out.strip(), out
