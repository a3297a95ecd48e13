"""Load a YAML job file into a validated :class:`~orchestrator.spec.job.JobSpec`.

The loader walks YAML *nodes* (not plain data) so that every problem can name
the line it comes from.  It is driven by the dataclass tree in
:mod:`orchestrator.spec.job`, read through :mod:`orchestrator.spec.dataclass_tree`:
field names, types and defaults come from there, so a new field needs no
loader change.  It collects every problem before raising,
so a person fixes a file in one pass, and unknown keys get a did-you-mean.

Every key may be written in snake_case (the job file's own spelling) or in
camelCase (``nprocPerNode``, ``faultTolerance.hangTimeout``: the Kubernetes
``TrainingJob`` spelling); a problem names the field the way the file spells
it, and one field given in both spellings is an error.
"""

from __future__ import annotations

import difflib
import math
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from orchestrator.spec.api import SpecError, SpecProblem
from orchestrator.spec.bounds import INT64_MAX, out_of_int64
from orchestrator.spec.dataclass_tree import (
    Shape,
    camel_key,
    describe,
    fields_of,
    join,
    snake_key,
    unknown_key_message,
)
from orchestrator.spec.job import (
    COMPRESSION_PARAMS,
    CompressionKind,
    CompressionSpec,
    EntrypointSpec,
    JobSpec,
    RendezvousSpec,
)

__all__ = [
    "load_job_data",
    "load_job_file",
    "load_job_node",
    "load_job_text",
]

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*\Z", re.ASCII)
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_MISSING = object()
_STR = Shape("str", str)
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
        SpecError: with every problem found, each naming its field path and line
            (a file that is not UTF-8 text: the first byte that is not, and its line).
        OSError: when the file cannot be read.
    """
    p = Path(path)
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError([_not_utf8(data, e, str(p))]) from e
    return load_job_text(text, source=str(p))


def _not_utf8(data: bytes, error: UnicodeDecodeError, source: str) -> SpecProblem:
    line = data.count(b"\n", 0, error.start) + 1
    column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
    return SpecProblem(
        "",
        f"the file is not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start} "
        f"(line {line}, column {column}) is not valid UTF-8; save the file as UTF-8",
        line,
        source,
    )


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
    """Build a :class:`JobSpec` from a composed YAML document (None: an empty file)."""
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
            script = self.scalar(_STR, node, path)
            return EntrypointSpec(script=script) if script is not _MISSING else _MISSING
        if not isinstance(node, yaml.MappingNode):
            self.add(path, f"must be a mapping of fields, got {_describe(node)}", _line(node))
            return _MISSING
        direct_failed: set[str] = set()
        nested_failed: set[str] = set()
        fields = {f.key: f for f in fields_of(cls)}
        # Every key may also be written in camelCase (the TrainingJob form).
        aliases = {camel_key(k): k for k in fields if camel_key(k) != k}
        given: dict[str, Any] = {}
        written: dict[str, str] = {}  # canonical key -> the key as written
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                self.add(path, f"keys must be strings, got {_describe(key_node)}", _line(key_node))
                continue
            sub = join(path, key)
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
                removed = _REMOVED_KEYS.get((cls, snake_key(key)))
                shown = [camel_key(k) for k in fields] if key != key.lower() else list(fields)
                message = removed or unknown_key_message(key, shown)
                self.add(sub, message, _line(key_node))
                continue
            value = self.value(f.shape, value_node, sub)
            if value is not _MISSING:
                given[f.name] = value
            elif f.shape.kind == "dataclass":
                nested_failed.add(canonical)
            else:
                direct_failed.add(canonical)
        seen = set(written)
        for key, f in fields.items():
            if f.required and f.name not in given:
                if key not in seen:
                    self.add(join(path, key), "is required", _line(node))
                if key in nested_failed:
                    given[f.name] = f.shape.type()  # placeholder; its problems are reported
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
            sub = join(path, written[key])
            params = ", ".join(COMPRESSION_PARAMS[kind]) or "none"
            self.add(
                sub,
                f"is not a parameter of compression '{kind.value}' (its parameters: {params})",
                self.lines.get(sub, _line(node)),
            )

    # -- values ------------------------------------------------------------------------

    def value(self, shape: Shape, node: yaml.Node, path: str) -> Any:
        if shape.optional and _is_null(node):
            return None
        if shape.kind == "dataclass":
            return self.build(shape.type, node, path)
        if shape.kind == "list":
            if not isinstance(node, yaml.SequenceNode):
                self.add(path, f"must be a list, got {_describe(node)}", _line(node))
                return _MISSING
            (item,) = shape.args
            items = [self.value(item, n, f"{path}[{i}]") for i, n in enumerate(node.value)]
            return _MISSING if _MISSING in items else items
        if shape.kind == "dict":
            if not isinstance(node, yaml.MappingNode):
                self.add(path, f"must be a mapping, got {_describe(node)}", _line(node))
                return _MISSING
            out: dict[str, Any] = {}
            for k, v in node.value:
                k_val = self.scalar(_STR, k, f"{path}.<key>")
                v_val = self.value(shape.args[0], v, f"{path}.{k.value}")
                if k_val is not _MISSING and v_val is not _MISSING:
                    out[k_val] = v_val
            return out
        return self.scalar(shape, node, path)

    def scalar(self, shape: Shape, node: yaml.Node, path: str) -> Any:
        kind, tp = shape.kind, shape.type
        if not isinstance(node, yaml.ScalarNode):
            self.add(path, f"must be {_type_name(tp)}, got {_describe(node)}", _line(node))
            return _MISSING
        raw = _construct(node)
        line = _line(node)
        if kind == "duration":
            return self._duration(raw, path, line)
        if kind == "enum":
            allowed = [m.value for m in tp]
            if raw not in allowed:
                hint = difflib.get_close_matches(str(raw), [str(a) for a in allowed], n=1)
                extra = f"; did you mean '{hint[0]}'?" if hint else ""
                self.add(path, f"'{raw}' is not one of: {', '.join(allowed)}{extra}", line)
                return _MISSING
            return tp(raw)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
        elif kind == "int":
            if isinstance(raw, int) and not isinstance(raw, bool):
                if abs(raw) <= INT64_MAX:
                    return raw
                self.add(path, out_of_int64(raw), line)
                return _MISSING
        elif kind == "float":
            if isinstance(raw, (int, float)) and not isinstance(raw, bool):
                try:
                    value = float(raw)
                except OverflowError:
                    value = math.inf
                if math.isfinite(value):
                    return value
                self.add(path, f"must be a finite number, got {raw!r}", line)
                return _MISSING
        elif kind == "str":
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
    return describe(_construct(node))


def _type_name(tp: Any) -> str:
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        timedelta: "a duration",
    }
    return names.get(tp, getattr(tp, "__name__", str(tp)))
