"""The job's entrypoint as seen from here: can it be found, and which recovery tier it needs.

Workers start in the directory ``ringmaster run`` or ``ringmaster agent`` runs
in; :func:`check_entrypoint` looks for the script or module there before
anything starts.  :func:`resolve_recovery` turns ``fault_tolerance.recovery:
auto`` into ``in_process`` or ``restart`` by reading the entrypoint's source
with :mod:`ast`: a script that imports the ringmaster runtime can keep its
memory through a failure, any other is restarted.  Runs in the CLI (``run``,
``submit``, ``validate``) and in the node agent.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import yaml

from orchestrator.spec.api import SpecError, SpecProblem
from orchestrator.spec.job import JobSpec, RecoveryMode, restart_tier_refusal

__all__ = ["check_entrypoint", "entrypoint_file", "resolve_recovery", "uses_runtime"]


def check_entrypoint(spec: JobSpec, workdir: str | Path, source: str = "<job>") -> None:
    """Check that the job's entrypoint can be found where its workers will start.

    Workers start in the directory ``ringmaster run`` or ``ringmaster agent``
    runs in, so a relative ``script`` is looked up there, and a ``module`` on
    this Python's path with that directory first.  Only what can be seen from
    here is checked: agents on other machines see their own files.

    Raises:
        SpecError: naming the field, what was looked for and where.
    """
    where = Path(workdir).resolve()
    entry = spec.entrypoint
    if entry.script is not None:
        path = Path(entry.script)
        full = path if path.is_absolute() else where / path
        if not full.is_file():
            message = (
                f"script '{entry.script}' was not found: looked for {full} (workers start "
                f"in {where}, the directory `ringmaster run` or `ringmaster agent` runs in); "
                "give a path relative to it or an absolute path"
            )
            raise SpecError([SpecProblem("entrypoint.script", message, None, source)])
        return
    top = str(entry.module).split(".", 1)[0]
    sys.path.insert(0, str(where))
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.remove(str(where))
    if not found:
        message = (
            f"module '{entry.module}' cannot be imported: '{top}' is neither in {where} "
            f"(where workers start) nor installed for {sys.executable}"
        )
        raise SpecError([SpecProblem("entrypoint.module", message, None, source)])


def entrypoint_file(spec: JobSpec, workdir: str | Path) -> Path | None:
    """The source file the job's workers run, when it can be found from here.

    A ``script`` is looked up as :func:`check_entrypoint` does; a ``module`` is
    found on this Python's path with ``workdir`` first (a package runs its
    ``__main__``).  None when there is no readable Python source.
    """
    where = Path(workdir).resolve()
    entry = spec.entrypoint
    if entry.script is not None:
        path = Path(entry.script)
        full = path if path.is_absolute() else where / path
        return full if full.is_file() else None
    sys.path.insert(0, str(where))
    try:
        found = importlib.util.find_spec(str(entry.module))
        if found is not None and found.submodule_search_locations:
            found = importlib.util.find_spec(f"{entry.module}.__main__")
    except (ImportError, ValueError):
        found = None
    finally:
        sys.path.remove(str(where))
    origin = getattr(found, "origin", None) if found is not None else None
    if origin and origin.endswith(".py") and Path(origin).is_file():
        return Path(origin)
    return None


#: How a script reaches the runtime: ``from agents import runtime``, ``import agents.runtime``...
_RUNTIME_MODULE = "agents.runtime"


def uses_runtime(source: str) -> bool:
    """Whether Python ``source`` imports the ringmaster worker runtime (``agents.runtime``).

    Read with :mod:`ast` (comments and strings do not count); a file that does
    not parse is searched as text for the import or a ``runtime.init(`` call.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return bool(
            re.search(r"\bfrom\s+agents\s+import\s+[^\n]*\bruntime\b", source)
            or re.search(r"\bimport\s+agents\.runtime\b|\bfrom\s+agents\.runtime\b", source)
            or "runtime.init(" in source
        )
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(
                a.name == _RUNTIME_MODULE or a.name.startswith(_RUNTIME_MODULE + ".")
                for a in node.names
            ):
                return True
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if node.module == "agents" and any(a.name == "runtime" for a in node.names):
                return True
            if node.module and (
                node.module == _RUNTIME_MODULE or node.module.startswith(_RUNTIME_MODULE + ".")
            ):
                return True
    return False


def resolve_recovery(
    spec: JobSpec, workdir: str | Path, source: str = "<job>", strict: bool = True
) -> tuple[JobSpec, str]:
    """The spec with ``fault_tolerance.recovery`` resolved, and why, in words.

    ``auto`` becomes ``in_process`` when the entrypoint imports the ringmaster
    runtime and ``restart`` otherwise (also when the source cannot be read
    here: a script that does use the runtime then refuses to start with one
    line, where an in-process job for a plain script would hang).

    Raises:
        SpecError: ``in_process`` was asked for but the entrypoint never uses
            the runtime (naming the file and what to do); or, with ``strict``,
            ``auto`` resolved to ``restart`` for a job that gives settings only
            the runtime acts on (:meth:`JobSpec.runtime_settings`: each named, with
            its line).  Without ``strict`` (an agent, after the submit) they are
            the caller's to report.
    """
    ft = spec.fault_tolerance
    path = entrypoint_file(spec, workdir)
    shown = _shown(spec, path, workdir)
    try:
        text = path.read_text(encoding="utf-8", errors="replace") if path else None
    except OSError:
        text = None
    calls = text is not None and uses_runtime(text)
    restart_why = "a peer's failure restarts all workers from the script's own checkpoint"
    if ft.recovery is RecoveryMode.IN_PROCESS:
        if text is not None and not calls:
            message = (
                f"is 'in_process' but {shown} never calls runtime.init() (it does not import "
                "agents.runtime), so its workers would wait forever for a process group: set "
                "'restart' (or 'auto') for a plain torchrun script, or use the runtime "
                "(see examples/train_tiny.py)"
            )
            line = _line_in_file(source, ("fault_tolerance", "recovery"))
            raise SpecError([SpecProblem("fault_tolerance.recovery", message, line, source)])
        why = "set in the job file" + ("" if text is not None else f"; {shown} not read here")
        return spec, f"recovery: in_process ({why})"
    if ft.recovery is RecoveryMode.RESTART:
        if strict:
            _refuse_runtime_settings(spec, source, "fault_tolerance.recovery 'restart'")
        return spec, f"recovery: restart (set in the job file; {restart_why})"
    if calls:
        mode = RecoveryMode.IN_PROCESS
        why = (
            f"recovery: in_process ({shown} uses the ringmaster runtime; survivors keep their "
            "memory and a replacement gets its state from a live peer)"
        )
    elif text is None:
        mode = RecoveryMode.RESTART
        because = f"{shown} cannot be read here to look for runtime.init()"
        why = f"recovery: restart ({because}; {restart_why})"
    else:
        mode = RecoveryMode.RESTART
        because = f"{shown} never calls runtime.init()"
        why = f"recovery: restart ({because}; {restart_why})"
    resolved = dataclasses.replace(spec, fault_tolerance=dataclasses.replace(ft, recovery=mode))
    if mode is RecoveryMode.RESTART and strict:
        tier = f"fault_tolerance.recovery 'auto', here 'restart' ({because}),"
        _refuse_runtime_settings(resolved, source, tier)
    return resolved, why


def _refuse_runtime_settings(spec: JobSpec, source: str, tier: str) -> None:
    """Raise :class:`SpecError` naming each setting of ``spec`` (a restart-tier job's)
    that only the ringmaster runtime acts on, with its line in ``source``."""
    found = spec.runtime_settings()
    if spec.sync.delayed:  # refused when the file says 'restart'; here for 'auto' too
        found.append(("sync.mode", "the sites' outer syncs run in the runtime"))
    if found:
        raise SpecError(
            [
                SpecProblem(
                    path,
                    restart_tier_refusal(reason, tier),
                    _line_in_file(source, tuple(path.split("."))),
                    source,
                )
                for path, reason in found
            ]
        )


def _line_in_file(source: str, path: tuple[str, ...]) -> int | None:
    """The line of the key at ``path`` in the job file ``source``, when it can be read."""
    try:
        node = yaml.compose(Path(source).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    line = None
    for key in path:
        if not isinstance(node, yaml.MappingNode):
            return line
        match = next(((k, v) for k, v in node.value if getattr(k, "value", None) == key), None)
        if match is None:
            return line
        line, node = int(match[0].start_mark.line) + 1, match[1]
    return line


def _shown(spec: JobSpec, path: Path | None, workdir: str | Path) -> str:
    """How a message names the entrypoint: the path as the job file gave it."""
    entry = spec.entrypoint
    if entry.script is not None:
        return str(entry.script)
    return f"module {entry.module}" + (f" ({path})" if path else "")
