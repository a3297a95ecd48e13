"""Load a YAML job file into a validated :class:`~orchestrator.spec.JobSpec`.

The loader walks YAML *nodes* (not plain data) so that every problem can name
the line it comes from.  It is driven by the dataclass tree in
:mod:`orchestrator.api`: field names, types and defaults come from there, so a
new field needs no loader change.  It collects every problem before raising,
so a person fixes a file in one pass, and unknown keys get a did-you-mean.

Every key may be written in snake_case (the job file's own spelling) or in
camelCase (``nprocPerNode``, ``faultTolerance.hangTimeout``: the Kubernetes
``TrainingJob`` spelling); a problem names the field the way the file spells
it, and one field given in both spellings is an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from orchestrator.api import SpecError, SpecProblem
from orchestrator.spec import (
    COMPRESSION_PARAMS,
    CompressionKind,
    CompressionSpec,
    EntrypointSpec,
    JobSpec,
    RecoveryMode,
    RendezvousSpec,
    camel_key,
)

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*\Z", re.ASCII)
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_MISSING = object()
#: Longest duration accepted (a century; timedelta itself ends near 2.7 million years).
_MAX_SECONDS = 100 * 365 * 24 * 3600.0

#: Keys that job files used to accept, by the spec class they were in: what to do instead.
_REMOVED_KEYS: dict[tuple[type, str], str] = {
    (RendezvousSpec, "close_timeout"): (
        "is no longer a job setting (nothing in a ringmaster job waited on it); delete it. "
        "torchrun's etcd-v3 backend takes close_timeout=<seconds> in --rdzv-conf"
    ),
    (RendezvousSpec, "heartbeat"): (
        "is no longer a job setting; delete it. A hung or dead worker is noticed through "
        "fault_tolerance.heartbeat_interval, a dead node when its registration lease "
        "(RINGMASTER_NODE_TTL) expires; torchrun's etcd-v3 backend takes "
        "heartbeat=<seconds> in --rdzv-conf"
    ),
}


def load_job_file(path: str | Path) -> JobSpec:
    """Read and validate a job file.

    Raises:
        SpecError: with every problem found, each naming its field path and line.
        OSError: when the file cannot be read.
    """
    p = Path(path)
    return load_job_text(p.read_text(encoding="utf-8"), source=str(p))


def check_entrypoint(spec: JobSpec, workdir: str | Path, source: str = "<job>") -> None:
    """Check that the job's entrypoint can be found where its workers will start.

    Workers start in the directory ``ringmaster run`` or ``ringmaster agent``
    runs in, so a relative ``script`` is looked up there, and a ``module`` on
    this Python's path with that directory first.  Only what can be seen from
    here is checked: agents on other machines see their own files.

    Raises:
        SpecError: naming the field, what was looked for and where.
    """
    import importlib.util
    import sys

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
    import importlib.util
    import sys

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
    import ast

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
    spec: JobSpec, workdir: str | Path, source: str = "<job>"
) -> tuple[JobSpec, str]:
    """The spec with ``fault_tolerance.recovery`` resolved, and why, in words.

    ``auto`` becomes ``in_process`` when the entrypoint imports the ringmaster
    runtime and ``restart`` otherwise (also when the source cannot be read
    here: a script that does use the runtime then refuses to start with one
    line, where an in-process job for a plain script would hang).

    Raises:
        SpecError: ``in_process`` was asked for but the entrypoint never uses
            the runtime (naming the file and what to do).
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
        return spec, f"recovery: restart (set in the job file; {restart_why})"
    if calls:
        mode = RecoveryMode.IN_PROCESS
        why = (
            f"recovery: in_process ({shown} uses the ringmaster runtime; survivors keep their "
            "memory and a replacement gets its state from a live peer)"
        )
    elif text is None:
        mode = RecoveryMode.RESTART
        why = f"recovery: restart ({shown} cannot be read here to look for runtime.init(); "
        why += restart_why + ")"
    else:
        mode = RecoveryMode.RESTART
        why = f"recovery: restart ({shown} never calls runtime.init(); {restart_why})"
    resolved = dataclasses.replace(spec, fault_tolerance=dataclasses.replace(ft, recovery=mode))
    return resolved, why


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
        line, node = _line(match[0]), match[1]
    return line


def _shown(spec: JobSpec, path: Path | None, workdir: str | Path) -> str:
    """How a message names the entrypoint: the path as the job file gave it."""
    entry = spec.entrypoint
    if entry.script is not None:
        return str(entry.script)
    return f"module {entry.module}" + (f" ({path})" if path else "")


def load_job_text(text: str, source: str = "<job>") -> JobSpec:
    """Parse YAML text into a validated :class:`JobSpec` (see :func:`load_job_file`)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        if mark is not None:
            line = mark.line + 1
        elif isinstance(getattr(e, "position", None), int):  # a character YAML cannot read
            line = text.count("\n", 0, e.position) + 1  # type: ignore[attr-defined]
        else:
            line = 1
        problem = getattr(e, "problem", None) or getattr(e, "reason", None) or str(e)
        raise SpecError([SpecProblem("", f"not valid YAML: {problem}", line, source)]) from e
    except RecursionError as e:
        raise SpecError([_too_deep(source)]) from e
    try:
        return load_job_node(root, source)
    except RecursionError as e:
        raise SpecError([_too_deep(source)]) from e


def _too_deep(source: str) -> SpecProblem:
    return SpecProblem(
        "",
        "the YAML is nested too deeply to be a job spec (lists or mappings inside "
        "thousands of others)",
        1,
        source,
    )


def load_job_data(data: dict[str, Any], source: str = "<job>") -> JobSpec:
    """Validate already-parsed data (e.g. a Kubernetes object's ``spec``)."""
    text = yaml.safe_dump(data, sort_keys=False)
    return load_job_text(text, source)


def load_job_node(root: yaml.Node | None, source: str) -> JobSpec:
    builder = _Builder(source)
    if root is None:
        builder.add("", "the job file is empty; it needs at least 'name' and 'entrypoint'", 1)
        raise SpecError(builder.problems)
    spec = builder.build(JobSpec, root, "")
    if builder.problems:
        raise SpecError(sorted(builder.problems, key=lambda p: p.line or 0))
    assert isinstance(spec, JobSpec)
    return spec


class _Builder:
    """Builds dataclasses from YAML nodes, recording problems and the line of each path."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[SpecProblem] = []
        self.lines: dict[str, int] = {}
        #: True once a camelCase key was read: problems are then named in camelCase.
        self.camel = False

    def add(self, path: str, message: str, line: int | None) -> None:
        self.problems.append(SpecProblem(path, message, line, self.source))

    def line_of(self, path: str) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path.rsplit(".", 1)[0] if "." in path else ""
        return self.lines.get("")

    # -- dataclasses -------------------------------------------------------------------

    def build(self, cls: type, node: yaml.Node, path: str) -> Any:
        self.lines.setdefault(path, node.start_mark.line + 1)
        if cls is EntrypointSpec and isinstance(node, yaml.ScalarNode):
            script = self.scalar(str, node, path)
            return EntrypointSpec(script=script) if script is not _MISSING else _MISSING
        if not isinstance(node, yaml.MappingNode):
            self.add(path, f"must be a mapping of fields, got {_describe(node)}", _line(node))
            return _MISSING
        direct_failed: set[str] = set()
        nested_failed: set[str] = set()
        hints = typing.get_type_hints(cls)
        fields = {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls)}
        # Every key may also be written in camelCase (the TrainingJob form).
        aliases = {camel_key(k): k for k in fields if camel_key(k) != k}
        given: dict[str, Any] = {}
        written: dict[str, str] = {}  # canonical key -> the key as written
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                self.add(path, f"keys must be strings, got {_describe(key_node)}", _line(key_node))
                continue
            sub = f"{path}.{key}" if path else key
            self.lines[sub] = _line(key_node)
            canonical = aliases.get(key, key)
            self.camel = self.camel or canonical != key
            if canonical in written:
                twice = "" if written[canonical] == key else f" (also as '{written[canonical]}')"
                self.add(sub, f"is given twice{twice}; keep one", _line(key_node))
                continue
            written[canonical] = key
            f = fields.get(canonical)
            if f is None:
                removed = _REMOVED_KEYS.get((cls, _snake_key(key)))
                shown = [camel_key(k) for k in fields] if key != key.lower() else list(fields)
                message = removed or _unknown_key_message(key, shown)
                self.add(sub, message, _line(key_node))
                continue
            tp = hints[f.name]
            value = self.value(tp, value_node, sub)
            if value is not _MISSING:
                given[f.name] = value
            elif dataclasses.is_dataclass(tp):
                nested_failed.add(canonical)
            else:
                direct_failed.add(canonical)
        seen = set(written)
        for key, f in fields.items():
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.name not in given:
                if key not in seen:
                    sub = f"{path}.{key}" if path else key
                    self.add(sub, "is required", _line(node))
                if key in nested_failed:
                    given[f.name] = hints[f.name]()  # placeholder; its problems are reported
                else:
                    return _MISSING  # a required scalar is missing: nothing to check
        if cls is CompressionSpec:
            self._check_compression_params(node, path, given, written)
        obj = cls(**given)
        failed = direct_failed | nested_failed
        # Defaults stand in for bad values: skip checks that involve a bad field
        # (by path, or by naming it in the message: "nodes.min (4) ... nodes.max").
        for sub, msg in obj.problems():
            if failed and (
                sub.split(".")[0] in failed
                or any(re.search(rf"\b{re.escape(k)}\b", msg) for k in failed)
            ):
                continue
            if self.camel:  # name the field the way the file spells its keys
                sub = ".".join(camel_key(part) for part in sub.split("."))
            full = ".".join(p for p in (path, sub) if p)
            self.add(full, msg, self.line_of(full))
        return _MISSING if failed else obj

    def _check_compression_params(
        self, node: yaml.Node, path: str, given: dict[str, Any], written: dict[str, str]
    ) -> None:
        kind = given.get("type", CompressionKind.NONE)
        if not isinstance(kind, CompressionKind):
            return
        allowed = set(COMPRESSION_PARAMS[kind]) | {"type", "inter_node_only"}
        for key in sorted(set(written) - allowed):
            sub = f"{path}.{written[key]}" if path else written[key]
            params = ", ".join(COMPRESSION_PARAMS[kind]) or "none"
            self.add(
                sub,
                f"is not a parameter of compression '{kind.value}' (its parameters: {params})",
                self.lines.get(sub, _line(node)),
            )

    # -- values ------------------------------------------------------------------------

    def value(self, tp: Any, node: yaml.Node, path: str) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            if _is_null(node):
                return None
            return self.value(inner[0], node, path)
        if dataclasses.is_dataclass(tp):
            return self.build(tp, node, path)  # type: ignore[arg-type]
        if origin is list:
            if not isinstance(node, yaml.SequenceNode):
                self.add(path, f"must be a list, got {_describe(node)}", _line(node))
                return _MISSING
            items = [self.value(args[0], n, f"{path}[{i}]") for i, n in enumerate(node.value)]
            return _MISSING if _MISSING in items else items
        if origin is dict:
            if not isinstance(node, yaml.MappingNode):
                self.add(path, f"must be a mapping, got {_describe(node)}", _line(node))
                return _MISSING
            out: dict[str, Any] = {}
            for k, v in node.value:
                k_val = self.scalar(str, k, f"{path}.<key>")
                v_val = self.value(args[1], v, f"{path}.{k.value}")
                if k_val is not _MISSING and v_val is not _MISSING:
                    out[k_val] = v_val
            return out
        return self.scalar(tp, node, path)

    def scalar(self, tp: Any, node: yaml.Node, path: str) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            self.add(path, f"must be {_type_name(tp)}, got {_describe(node)}", _line(node))
            return _MISSING
        raw = _construct(node)
        line = _line(node)
        if tp is timedelta:
            return self._duration(raw, path, line)
        if isinstance(tp, type) and issubclass(tp, Enum):
            allowed = [m.value for m in tp]
            if raw not in allowed:
                hint = difflib.get_close_matches(str(raw), [str(a) for a in allowed], n=1)
                extra = f"; did you mean '{hint[0]}'?" if hint else ""
                self.add(path, f"'{raw}' is not one of: {', '.join(allowed)}{extra}", line)
                return _MISSING
            return tp(raw)
        if tp is bool:
            if isinstance(raw, bool):
                return raw
        elif tp is int:
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
        elif tp is float:
            if isinstance(raw, (int, float)) and not isinstance(raw, bool):
                try:
                    value = float(raw)
                except OverflowError:
                    value = math.inf
                if math.isfinite(value):
                    return value
                self.add(path, f"must be a finite number, got {raw!r}", line)
                return _MISSING
        elif tp is str:
            if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
                return str(raw)
        else:  # pragma: no cover - a field type the loader does not know
            raise TypeError(f"unsupported field type {tp!r} at {path}")
        self.add(path, f"must be {_type_name(tp)}, got {_describe(node)}", line)
        return _MISSING

    def _duration(self, raw: Any, path: str, line: int) -> Any:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            try:
                seconds = float(raw)
            except OverflowError:
                seconds = math.inf
            if math.isnan(seconds):
                self.add(path, f"must be a duration, got {raw!r}", line)
                return _MISSING
            if seconds < 0:
                self.add(path, f"must be a positive duration, got {raw!r}", line)
                return _MISSING
        elif isinstance(raw, str) and (m := _DURATION_RE.match(raw)):
            seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        elif isinstance(raw, str) and raw.strip().startswith("-"):
            self.add(path, f"must be a positive duration, got '{raw}'", line)
            return _MISSING
        else:
            self.add(
                path,
                f"must be a duration in seconds or with a unit (500ms, 30s, 5m, 1h), got {raw!r}",
                line,
            )
            return _MISSING
        if seconds > _MAX_SECONDS:
            self.add(
                path, f"must be at most {_MAX_SECONDS:g}s (about a century), got {raw!r}", line
            )
            return _MISSING
        return timedelta(seconds=seconds)


def _construct(node: yaml.Node) -> Any:
    """The Python value of a scalar node, by YAML's safe rules (``true`` → True, ``3`` → 3)."""
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if _is_null(node):
        return "nothing (null)"
    value = _construct(node)
    kind = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
        type(value), type(value).__name__
    )
    return f"{kind} {value!r}"


def _type_name(tp: Any) -> str:
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        timedelta: "a duration",
    }
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _snake_key(key: str) -> str:
    """``closeTimeout`` → ``close_timeout`` (the inverse of :func:`camel_key`)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", lambda m: "_" + m.group(1).lower(), key)


def _unknown_key_message(key: str, known: list[str]) -> str:
    close = (
        difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        or [k for k in known if k.startswith(key) or key.startswith(k)][:1]
    )
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown key '{key}'; {hint}known keys here: {', '.join(known)}"
