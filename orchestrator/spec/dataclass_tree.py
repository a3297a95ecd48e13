"""One walker over dataclass trees: a dataclass's fields, and each field's type, as data.

The job spec (:mod:`orchestrator.spec.job`), the TrainingJob's own fields
(:mod:`orchestrator.operator.trainingjob`) and the records stored in etcd
(:mod:`orchestrator.state.records`) are trees of dataclasses.  Four things walk
them: the job-file loader (YAML with line numbers, :mod:`orchestrator.spec.loader`),
the reader of plain data with field paths (:mod:`orchestrator.spec.dict_loader`),
the record codec (:mod:`orchestrator.state.codec`) and the CRD schema
(:mod:`orchestrator.operator.crd_schema`).  They ask a type the same questions
(which fields, under which key, of which type, required or with which default)
and this module answers them once per class: :func:`fields_of` and
:func:`shape_of`.  Each reader keeps only its own rules: what it accepts and
how it words a problem.  :func:`plain` is the way back, a tree to plain data.

Pure, no I/O; runs in every process.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, Literal

__all__ = [
    "FieldInfo",
    "Kind",
    "Shape",
    "camel_key",
    "describe",
    "fields_of",
    "join",
    "nested_problems",
    "plain",
    "shape_of",
    "snake_key",
    "unknown_key_message",
]

#: What a type is, for a reader: ``any`` is ``typing.Any`` (or a union of several types).
Kind = Literal[
    "dataclass", "list", "tuple", "dict", "enum", "duration", "bool", "int", "float", "str", "any"
]

_SCALARS: dict[Any, Kind] = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    timedelta: "duration",
}


@dataclass(frozen=True)
class Shape:
    """A field's type, taken apart.

    Attributes:
        kind: what it is (see :data:`Kind`).
        type: the bare type: the dataclass, the Enum, ``int``...; ``Any`` for ``any``.
        optional: None is a valid value (``X | None``).
        args: ``list``: the item's shape; ``dict``: the value's; ``tuple``: each position's.
    """

    kind: Kind
    type: Any
    optional: bool = False
    args: tuple[Shape, ...] = ()


@functools.cache
def shape_of(tp: Any) -> Shape:
    """The :class:`Shape` of a (resolved) type annotation.

    Raises:
        TypeError: a type no reader knows (a walker must not guess).
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            return Shape("any", Any, optional=len(inner) < len(args))
        return dataclasses.replace(shape_of(inner[0]), optional=len(inner) < len(args))
    if tp is Any:
        return Shape("any", Any)
    if dataclasses.is_dataclass(tp):
        return Shape("dataclass", tp)
    if origin is list:
        return Shape("list", list, args=(shape_of(args[0]),))
    if origin is dict:
        return Shape("dict", dict, args=(shape_of(args[1]),))
    if origin is tuple:
        return Shape("tuple", tuple, args=tuple(shape_of(a) for a in args))
    if isinstance(tp, type) and issubclass(tp, Enum):
        return Shape("enum", tp)
    if tp in _SCALARS:
        return Shape(_SCALARS[tp], tp)
    raise TypeError(f"no dataclass walker knows the field type {tp!r}")


@dataclass(frozen=True)
class FieldInfo:
    """One field of a dataclass, as every walker sees it.

    Attributes:
        name: the Python attribute.
        key: its key in a file or a mapping: ``metadata["key"]`` when given
            (``async`` for ``async_``), else ``name``.
        shape: its type (:func:`shape_of`).
        required: it has neither a default nor a default factory.
        field: the dataclass field (its ``metadata`` holds what a walker's own rules read).
    """

    name: str
    key: str
    shape: Shape
    required: bool
    field: dataclasses.Field[Any]

    @property
    def camel(self) -> str:
        """The key in camelCase (the Kubernetes spelling)."""
        return camel_key(self.key)

    @property
    def metadata(self) -> typing.Mapping[str, Any]:
        return self.field.metadata

    def default(self) -> Any:
        """A fresh default value (None for a required field)."""
        if self.field.default is not dataclasses.MISSING:
            return self.field.default
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return None


_FIELDS: dict[type, tuple[FieldInfo, ...]] = {}


def fields_of(cls: type) -> tuple[FieldInfo, ...]:
    """The fields of dataclass ``cls``, in order, worked out once per class.

    ``typing.get_type_hints`` evaluates every annotation string again on each
    call; uncached it was 80% of a controller tick at scale (records are read
    on every tick).
    """
    found = _FIELDS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _FIELDS[cls] = tuple(
            FieldInfo(
                name=f.name,
                key=f.metadata.get("key", f.name),
                shape=shape_of(hints[f.name]),
                required=(
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                ),
                field=f,
            )
            for f in dataclasses.fields(cls)
        )
    return found


# --------------------------------------------------------------------------- keys and paths


def camel_key(key: str) -> str:
    """The camelCase spelling of a key (``nproc_per_node`` → ``nprocPerNode``).

    A job file may use either spelling; a Kubernetes ``TrainingJob`` uses this one.
    """
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def snake_key(key: str) -> str:
    """``closeTimeout`` → ``close_timeout`` (the inverse of :func:`camel_key`)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", lambda m: "_" + m.group(1).lower(), key)


def join(path: str, key: str) -> str:
    """The dotted path of ``key`` under ``path`` (``""`` is the root)."""
    return f"{path}.{key}" if path else key


# --------------------------------------------------------------------------- messages


def describe(value: Any) -> str:
    """A plain value as a problem names it: ``a mapping``, ``integer 3``, ``string 'x'``."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    return f"{names.get(type(value), type(value).__name__)} {value!r}"


def unknown_key_message(key: str, known: list[str], noun: str = "key") -> str:
    """``unknown key 'nodez'; did you mean 'nodes'? known keys here: ...``."""
    close = (
        difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        or [k for k in known if k.startswith(key) or key.startswith(k)][:1]
    )
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown {noun} '{key}'; {hint}known {noun}s here: {', '.join(known)}"


def nested_problems(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``obj.problems()`` and those of every dataclass under it, with full dotted paths.

    Each class of a spec tree says what it sees wrong on its own as
    ``(relative path, message)`` pairs (``problems()``).
    """
    out = [(join(prefix, path) if path else prefix, msg) for path, msg in obj.problems()]
    for f in fields_of(type(obj)):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += nested_problems(value, join(prefix, f.key))
    return out


# --------------------------------------------------------------------------- the way back


_ATOMS = frozenset({str, int, float, bool, type(None)})


def _seconds(value: timedelta) -> Any:
    return value.total_seconds()


def plain(value: Any, duration: Callable[[timedelta], Any] = _seconds) -> Any:
    """``value`` as plain data: dataclasses by their keys, enums by value, tuples as lists.

    Args:
        value: a dataclass tree, or any part of one.
        duration: how a :class:`~datetime.timedelta` is written (default: seconds).
    """
    kind = type(value)
    if kind in _ATOMS:  # most values: checked first, records are encoded on every tick
        return value
    if hasattr(kind, "__dataclass_fields__"):
        return {f.key: plain(getattr(value, f.name), duration) for f in fields_of(kind)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, timedelta):
        return duration(value)
    if isinstance(value, (list, tuple)):
        return [plain(v, duration) for v in value]
    if isinstance(value, dict):
        return {k: plain(v, duration) for k, v in value.items()}
    return value
