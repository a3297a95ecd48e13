"""Check that ringmaster's top-level packages are ringmaster's own.

The distribution installs three top-level packages, ``agents``,
``checkpoint`` and ``orchestrator``, whose names other distributions use too
(``openai-agents`` installs ``agents``), and a script's own directory comes
first on ``sys.path`` (a project with its own ``checkpoint/`` package).  When
one of them shadows ringmaster's, imports fail far from the cause
("cannot import name 'runtime' from 'agents'").  :func:`check_own_packages`
finds that up front and names both files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from orchestrator.api import PackageClashError

#: ringmaster's top-level packages; they are installed side by side.
OWN_PACKAGES = ("agents", "checkpoint", "orchestrator")

_ROOT = Path(__file__).resolve().parents[1]


def check_own_packages(root: Path = _ROOT) -> None:
    """Raise :class:`PackageClashError` when a package of ringmaster's resolves elsewhere.

    ``root`` is the directory that holds ringmaster's packages (this module's
    package's parent); each of :data:`OWN_PACKAGES` must resolve to
    ``root/<name>/__init__.py``.  Resolving does not import anything new.
    """
    for name in OWN_PACKAGES:
        spec = importlib.util.find_spec(name)
        expected = root / name / "__init__.py"
        found = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if found == expected.resolve():
            continue
        where = str(found) if found is not None else "a namespace package without __init__.py"
        raise PackageClashError(
            f"the top-level package {name!r} is imported from {where}, which shadows "
            f"ringmaster's {expected}: another distribution or a directory on sys.path "
            f"uses that name; uninstall it (pip uninstall) or rename the directory, "
            f"or run ringmaster in an environment without it"
        )
