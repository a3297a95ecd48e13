"""How a stored record is written and read back: JSON, a format version, checked types.

The records themselves are in :mod:`orchestrator.state.records`, beside the
keyspace; this module is their machinery.  :class:`Record` is their base:
``to_dict``/``encode`` add the format version ``"v"``; ``from_dict`` and
:func:`decode` check every field against the dataclass's types and raise
:class:`RecordError`, naming the key, for a missing field, a wrong type or a
record of a newer format.  :func:`read`, :func:`read_all` and :func:`write`
are the etcd side of it.  The fields and their types come from
:mod:`orchestrator.spec.dataclass_tree`; this module keeps a record's own rules
(checks stop at the first problem, unknown keys are left for newer writers).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from orchestrator.spec.dataclass_tree import Shape, fields_of, plain
from orchestrator.state.api import RecordError

if TYPE_CHECKING:
    from orchestrator.etcd.client import EtcdClient
    from orchestrator.etcd.kv import Lease

#: Format version of every record written by this release.
FORMAT = 1

R = TypeVar("R", bound="Record")


class Record:
    """Base of the stored records: JSON with a format version, checked on read."""

    #: The format version this class writes and the newest it reads.
    VERSION: ClassVar[int] = FORMAT

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = plain(self)
        out["v"] = self.VERSION
        return out

    def encode(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls: type[R], data: Any, key: str = "<record>") -> R:
        """Build the record from stored data.

        Raises:
            RecordError: naming ``key``, the field and what was wrong.
        """
        if not isinstance(data, dict):
            raise RecordError(f"{key}: expected a {cls.__name__} object, got {_kind(data)}")
        version = data.get("v")
        if not isinstance(version, int) or isinstance(version, bool):
            raise RecordError(f"{key}: {cls.__name__} has no format version ('v')")
        if version > cls.VERSION:
            raise RecordError(
                f"{key}: {cls.__name__} format {version} is newer than this ringmaster "
                f"reads ({cls.VERSION}); upgrade ringmaster on this machine"
            )
        values: dict[str, Any] = {}
        for f in fields_of(cls):
            if f.name in data:
                values[f.name] = _convert(data[f.name], f.shape, f"{key}: {f.name}")
            elif f.required:
                raise RecordError(f"{key}: {cls.__name__} is missing the field {f.name!r}")
        return cls(**values)


def decode(cls: type[R], raw: bytes | str | None, key: str) -> R:
    """Parse one stored value as ``cls``.

    Raises:
        RecordError: the value is missing, not JSON or not a ``cls``; the
            message names ``key``.
    """
    if raw is None:
        raise RecordError(f"{key}: no {cls.__name__} stored there")
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise RecordError(f"{key}: not JSON ({e})") from e
    return cls.from_dict(data, key)


# ------------------------------------------------------------------------------ etcd


def read(client: EtcdClient, key: str, cls: type[R]) -> R | None:
    """The record at ``key``, or None when nothing is stored there.

    Raises:
        RecordError: something is stored but it is not a ``cls``.
        EtcdError: etcd did not answer.
    """
    kv = client.get(key)
    return None if kv is None else decode(cls, kv.value, key)


def read_all(client: EtcdClient, prefix: str, cls: type[R]) -> dict[str, R]:
    """Every record under ``prefix``, by the last segment of its key (in key order)."""
    return {
        kv.key.rsplit("/", 1)[1]: decode(cls, kv.value, kv.key) for kv in client.get_prefix(prefix)
    }


def write(client: EtcdClient, key: str, record: Record, lease: Lease | None = None) -> int:
    """Store ``record`` at ``key``; returns the revision."""
    return client.put(key, record.encode(), lease=lease)


# --------------------------------------------------------------------------- helpers


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _convert(value: Any, shape: Shape, where: str) -> Any:
    """``value`` checked (and, for nested records and enums, built) as a ``shape``."""
    if value is None and shape.optional:
        return None
    kind = shape.kind
    if kind == "dataclass":
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {_kind(value)}")
        return shape.type.from_dict({**value, "v": shape.type.VERSION}, where)
    if kind == "enum":
        try:
            return shape.type(value)
        except ValueError as e:
            valid = ", ".join(str(m.value) for m in shape.type)
            raise RecordError(f"{where}: {value!r} is not one of {valid}") from e
    if kind == "list":
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {_kind(value)}")
        (item,) = shape.args
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind == "tuple":
        if not isinstance(value, (list, tuple)) or len(value) != len(shape.args):
            raise RecordError(f"{where}: expected {len(shape.args)} values, got {value!r}")
        return tuple(_convert(v, a, where) for v, a in zip(value, shape.args, strict=True))
    if kind == "dict":
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {_kind(value)}")
        (inner,) = shape.args
        return {str(k): _convert(v, inner, f"{where}.{k}") for k, v in value.items()}
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise RecordError(f"{where}: expected a number, got {_kind(value)}")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecordError(f"{where}: expected an integer, got {_kind(value)}")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise RecordError(f"{where}: expected true or false, got {_kind(value)}")
    if kind == "str":
        if isinstance(value, str):
            return value
        raise RecordError(f"{where}: expected a string, got {_kind(value)}")
    return value  # ``any``
