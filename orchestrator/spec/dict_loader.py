"""Build a dataclass tree from plain data (a Kubernetes object), naming every problem's path.

The job file has its own loader (:mod:`orchestrator.spec.loader`: YAML
nodes, line numbers, either key spelling).  This one reads data that has no
lines, a TrainingJob's own fields (:mod:`orchestrator.operator.trainingjob`):
keys in camelCase, every problem collected with its field path
(``template.spec.tolerations[0].effect``).  Fields and types come from
:mod:`orchestrator.spec.dataclass_tree`; a field's metadata adds the checks the
CRD schema states too (``minimum``, ``enum``, ``quantity``, a free-form
``schema`` whose items need a ``name``).  Pure; runs in the operator.
"""

from __future__ import annotations

from typing import Any, TypeVar

from orchestrator.spec.api import SpecError, SpecProblem
from orchestrator.spec.dataclass_tree import FieldInfo, Shape, describe, fields_of, join
from orchestrator.spec.dataclass_tree import unknown_key_message as unknown

__all__ = ["load_dataclass"]

T = TypeVar("T")
_BAD = object()


def load_dataclass(cls: type[T], data: Any, source: str) -> T:
    """``data`` as a ``cls``, its keys in camelCase.

    Raises:
        SpecError: every problem, each with its field path.
    """
    reader = _Reader(source)
    out = reader.build(cls, data, "")
    if reader.problems:
        raise SpecError(reader.problems)
    assert isinstance(out, cls)
    return out


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[SpecProblem] = []

    def add(self, path: str, message: str) -> Any:
        self.problems.append(SpecProblem(path, message, None, self.source))
        return _BAD

    def build(self, cls: type, data: Any, path: str) -> Any:
        if not isinstance(data, dict):
            return self.add(path, f"must be a mapping, got {describe(data)}")
        fields = {f.camel: f for f in fields_of(cls)}
        given: dict[str, Any] = {}
        bad = False
        for key, value in data.items():
            sub = join(path, str(key))
            f = fields.get(str(key))
            if f is None:
                self.add(sub, unknown(str(key), list(fields), noun="field"))
                bad = True
                continue
            got = self.value(f.shape, f, value, sub)
            if got is _BAD:
                bad = True
            else:
                given[f.name] = got
        for key, f in fields.items():
            if f.required and f.name not in given and key not in data:
                self.add(join(path, key), "is required")
                bad = True
        return _BAD if bad else cls(**given)

    def value(self, shape: Shape, f: FieldInfo, value: Any, path: str) -> Any:
        if value is None and shape.optional:
            return None
        kind, meta = shape.kind, f.metadata

        def fail(what: str) -> Any:
            return self.add(path, f"must be {what}, got {describe(value)}")

        if kind == "dataclass":
            return self.build(shape.type, value, path)
        if kind == "list":
            if not isinstance(value, list):
                return fail("a list")
            items = [self.value(shape.args[0], f, v, f"{path}[{i}]") for i, v in enumerate(value)]
            return _BAD if _BAD in items else items
        if kind == "dict":
            if not isinstance(value, dict):
                return fail("a mapping")
            if shape.args[0].kind == "any":  # a free-form Kubernetes object (a Volume...)
                item = (meta.get("schema") or {}).get("items") or {}
                if "name" in item.get("required", ()) and not isinstance(value.get("name"), str):
                    return self.add(path, "needs a 'name' (a string)")
                return dict(value)
            return self.strings(value, path, quantity=bool(meta.get("quantity")))
        if kind == "bool":
            return value if isinstance(value, bool) else fail("true or false")
        if kind == "int":
            if not isinstance(value, int) or isinstance(value, bool):
                return fail("an integer")
            low = meta.get("minimum")
            if low is not None and value < low:
                return self.add(path, f"must be {low} or more, got {value}")
            return value
        if kind == "str":
            if not isinstance(value, str):
                return fail("a string")
            allowed = meta.get("enum")
            if allowed and value not in allowed:
                return self.add(path, f"'{value}' is not one of: {', '.join(allowed)}")
            return value
        raise TypeError(f"no reader for field type {shape.type!r} at {path}")  # pragma: no cover

    def strings(self, value: dict[Any, Any], path: str, quantity: bool) -> Any:
        """A mapping of strings (or of Kubernetes quantities, which may be numbers)."""
        out: dict[str, Any] = {}
        for k, v in value.items():
            number = isinstance(v, int | float) and not isinstance(v, bool)
            if not (isinstance(v, str) or (quantity and number)):
                what = "a quantity (2, 500m, 4Gi)" if quantity else "a string"
                return self.add(f"{path}.{k}", f"must be {what}, got {describe(v)}")
            out[str(k)] = str(v)
        return out
