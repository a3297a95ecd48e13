"""How a stored record is written and read back: JSON, a format version, checked types.

The records themselves are in :mod:`orchestrator.records`, beside the
keyspace; this module is their machinery.  :class:`Record` is their base:
``to_dict``/``encode`` add the format version ``"v"``; ``from_dict`` and
:func:`decode` check every field against the dataclass's types and raise
:class:`RecordError`, naming the key, for a missing field, a wrong type or a
record of a newer format.  :func:`read`, :func:`read_all` and :func:`write`
are the etcd side of it.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Union

from orchestrator.api import OrchestratorError

if TYPE_CHECKING:
    from orchestrator.etcd.client import EtcdClient
    from orchestrator.etcd.kv import Lease

#: Format version of every record written by this release.
FORMAT = 1

R = TypeVar("R", bound="Record")


class RecordError(OrchestratorError):
    """A stored value is missing, is not JSON, or does not match its record type."""


class Record:
    """Base of the stored records: JSON with a format version, checked on read."""

    #: The format version this class writes and the newest it reads.
    VERSION: ClassVar[int] = FORMAT

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
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
        for name, hint, required in _schema(cls):
            if name in data:
                values[name] = _convert(data[name], hint, f"{key}: {name}")
            elif required:
                raise RecordError(f"{key}: {cls.__name__} is missing the field {name!r}")
        return cls(**values)


#: Record class → ``(name, type, required)`` of each of its fields (see :func:`_schema`).
_SCHEMAS: dict[type, tuple[tuple[str, Any, bool], ...]] = {}


def _schema(cls: type[Record]) -> tuple[tuple[str, Any, bool], ...]:
    """``(name, type, required)`` for each field of ``cls``, worked out once per class.

    ``typing.get_type_hints`` evaluates every annotation string again on each
    call; uncached it was 80% of a controller tick at scale.
    """
    found = _SCHEMAS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _SCHEMAS[cls] = tuple(
            (
                f.name,
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        )
    return found


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


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        out = value.to_dict()
        out.pop("v", None)  # nested records share their parent's version
        return out
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked (and, for nested records and enums, built) as type ``hint``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(value, inner[0], where)
        return value
    if hint is Any:
        return value
    if isinstance(hint, type) and issubclass(hint, Record):
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {_kind(value)}")
        return hint.from_dict({**value, "v": hint.VERSION}, where)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError as e:
            valid = ", ".join(str(m.value) for m in hint)
            raise RecordError(f"{where}: {value!r} is not one of {valid}") from e
    if origin is list:
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {_kind(value)}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise RecordError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(_convert(v, a, where) for v, a in zip(value, args, strict=True))
    if origin is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {_kind(value)}")
        return {str(k): _convert(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise RecordError(f"{where}: expected a number, got {_kind(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecordError(f"{where}: expected an integer, got {_kind(value)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise RecordError(f"{where}: expected true or false, got {_kind(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise RecordError(f"{where}: expected a string, got {_kind(value)}")
    return value
