"""One typed record for every value stored under :mod:`orchestrator.keys`.

Agents, workers, the controller and the CLI talk through etcd; what they
write there is one of the dataclasses below, never a hand-built dict.  Each
record is stored as JSON with a format version (``"v"``) beside its fields.
Reading goes through :func:`decode`, which checks every field against the
record's types: a missing required field, a value of the wrong type or a
record written by a newer format is a :class:`RecordError` that names the
key, never a silent default.  Fields with a default in the dataclass are
optional in the stored form (they were added later or are often empty).

The records, by key (see :mod:`orchestrator.keys` for the layout):

==========================  =========================================
``spec``                    :class:`SpecRecord`
``status``                  :class:`JobStatus`
``events/<seq>``            :class:`Event`
``nodes/<node>``            :class:`NodeRecord` (leased)
``commands/<seq>``          :class:`CommandRecord`
``plan``                    :class:`Plan` (of :class:`Member`)
``checkpoint``              :class:`CheckpointRecord`
``control``                 :class:`ControlRecord`
``reports/<gen>/<w>``       :class:`BreakReport`
``progress/<w>``            :class:`ProgressRecord` (with :class:`Telemetry`)
``done/<w>``                :class:`DoneRecord`
``agents/<node>/cmd/<seq>`` :class:`AgentCommand`
``logs/<node>/<lr>/<t>``    :class:`LogChunk`
``history/<ns>``            :class:`HistorySample`
``recoveries/<gen>``        :class:`RecoveryRecord`
==========================  =========================================
"""

from __future__ import annotations

import dataclasses
import json
import time
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Union

from orchestrator.api import JobPhase, OrchestratorError

if TYPE_CHECKING:
    from orchestrator.etcd.client import EtcdClient, Lease

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
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in data:
                values[f.name] = _convert(data[f.name], hints[f.name], f"{key}: {f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
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


# --------------------------------------------------------------------- etcd helpers


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
        kv.key.rsplit("/", 1)[1]: decode(cls, kv.value, kv.key)
        for kv in client.get_prefix(prefix)
    }


def write(client: EtcdClient, key: str, record: Record, lease: Lease | None = None) -> int:
    """Store ``record`` at ``key``; returns the revision."""
    return client.put(key, record.encode(), lease=lease)


# --------------------------------------------------------------------------- records


@dataclass
class Member(Record):
    """One node of a generation and the global ranks its workers take.

    Ranks ``rank_base .. rank_base + nproc - 1`` belong to this node, in local-rank
    order; nodes appear in topology order, so ring neighbours share host, then rack.
    """

    node: str
    rank_base: int
    nproc: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Plan(Record):
    """Who trains in a generation.  Written by the controller, read by every worker.

    A new generation is published whenever membership changes (failure, hot-swap,
    drain, scale); workers of the listed nodes re-form the process group for it
    in-process.  ``generation`` only grows; it also fences stale writers.
    """

    generation: int
    members: list[Member]
    spares: list[str] = field(default_factory=list)
    reason: str = ""

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    def member(self, node: str) -> Member | None:
        return next((m for m in self.members if m.node == node), None)


@dataclass
class NodeRecord(Record):
    """A node agent's registration (leased: it disappears with the agent)."""

    host: str
    address: str
    slots: int
    pid: int
    worker_pids: list[int]
    started: float
    labels: dict[str, str] = field(default_factory=dict)
    #: ``host:port`` of the agent's liveness port (None when it has none)
    liveness: str | None = None


@dataclass
class Telemetry(Record):
    """What a worker measured about itself (see :mod:`agents.telemetry`)."""

    generation: int = 0
    group_formed_at: float | None = None
    restored_at: float | None = None
    restored_step: int | None = None
    first_step_at: float | None = None
    checkpoint_blocking_s: float | None = None
    checkpoint_upload_s: float | None = None
    wire_bytes: int = 0
    dense_bytes: int = 0


@dataclass
class ProgressRecord(Record):
    """A worker's heartbeat: where it is, and when it last beat and last stepped."""

    step: int
    generation: int
    rank: int
    world_size: int
    pid: int
    #: wall-clock time of this beat (``time.time()``)
    beat: float
    #: wall-clock time the step counter last moved
    step_time: float
    recoveries: int = 0
    last_recovery_s: float | None = None
    paused: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    telemetry: Telemetry = field(default_factory=Telemetry)


@dataclass
class BreakReport(Record):
    """A worker saw its generation end (a peer is gone, or a planned switch)."""

    step: int
    reason: str
    planned: bool
    at: float
    #: the step raised an error of the script's own (not a peer's failure): the
    #: worker exits with it, and the controller restarts or fails the job
    user_error: bool = False


@dataclass
class DoneRecord(Record):
    """A worker finished its training loop."""

    step: int
    generation: int
    at: float


@dataclass
class ControlRecord(Record):
    """Requests to the workers, agreed on by every rank at one step boundary."""

    #: grows by one for each requested checkpoint
    checkpoint: int = 0
    stop: bool = False


@dataclass
class CommandRecord(Record):
    """A user's command to the controller (``stop``, ``checkpoint``)."""

    command: str
    args: dict[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.time)


@dataclass
class AgentCommand(Record):
    """The controller's command to one node agent (``kill-worker``, ``stop``)."""

    command: str
    local_rank: int = -1
    #: the process the command is about: a restarted worker is never its target
    pid: int | None = None
    reason: str = ""


@dataclass
class CheckpointRecord(Record):
    """The newest committed durable checkpoint, written by rank 0 (fenced)."""

    url: str
    step: int
    reason: str
    at: float


@dataclass
class ResumeRequest(Record):
    """Where a resubmitted job's workers take their first state from.

    Attributes:
        url: a committed checkpoint directory.
        step: its step (for messages).
        world_size: ranks that saved it (the job may run at another size).
    """

    url: str
    step: int
    world_size: int


@dataclass
class SpecRecord(Record):
    """A submitted job: its spec (as plain data), its hash and the resume point."""

    spec: dict[str, Any]
    hash: str
    submitted_at: float
    resume: ResumeRequest | None = None


@dataclass
class JobStatus(Record):
    """What the controller reports about a job (``/ringmaster/jobs/<job>/status``)."""

    name: str
    phase: JobPhase = JobPhase.PENDING
    step: int = 0
    world_size: int = 0
    generation: int = 0
    active_nodes: list[str] = field(default_factory=list)
    spare_nodes: list[str] = field(default_factory=list)
    failed_nodes: list[str] = field(default_factory=list)
    recoveries: int = 0
    last_checkpoint: str | None = None
    last_checkpoint_at: float | None = None
    message: str = ""
    updated_at: float = 0.0
    # observability (orchestrator.observe.job_observer)
    steps_per_s: float = 0.0
    samples_per_s: float | None = None
    loss: float | None = None
    submitted_at: float = 0.0
    train_started_at: float | None = None
    last_step_at: float | None = None
    finished_at: float | None = None
    productive_s: float = 0.0
    effective_fraction: float = 0.0
    last_recovery: dict[str, Any] | None = None


@dataclass
class Event(Record):
    """One entry of a job's event log."""

    type: str
    message: str
    time: float = field(default_factory=time.time)
    source: str = "controller"
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class LogChunk(Record):
    """Lines of one worker's output: ``(wall time, text)`` pairs."""

    node: str
    local_rank: int
    lines: list[tuple[float, str]]


@dataclass
class HistorySample(Record):
    """The job at one moment.

    Attributes:
        time: wall-clock seconds.
        step: highest step completed.
        steps_per_s: recent training rate.
        samples_per_s: recent throughput in samples (None when workers do
            not report ``samples``).
        loss: rank 0's last reported loss (None when the script reports none).
        phase: the job phase.
        world_size: ranks training.
    """

    time: float
    step: int
    steps_per_s: float
    samples_per_s: float | None
    loss: float | None
    phase: str
    world_size: int


#: The recovery phases, in order (see :mod:`orchestrator.observe.recoveries`).
PHASES = ("detect", "rendezvous", "restore", "first_step")


@dataclass
class RecoveryRecord(Record):
    """One recovery, as stored under ``/ringmaster/jobs/<job>/recoveries/<gen>``.

    Attributes:
        generation: the generation that trains again.
        cause: a ``FailureCause`` value.
        nodes: the nodes declared failed.
        reason: the controller's one-line explanation.
        failure_at, declared_at, group_formed_at, restored_at, first_step_at:
            the phase boundaries (wall-clock seconds), already clamped.
        step: the step that was running when the generation broke.
        restored_step: the step the new generation started from.
        observed_s: the controller's own measurement, from the failure to the
            moment it saw every worker of the new generation past ``step``.
    """

    generation: int
    cause: str
    nodes: list[str]
    reason: str
    failure_at: float
    declared_at: float
    group_formed_at: float
    restored_at: float
    first_step_at: float
    step: int = 0
    restored_step: int = 0
    observed_s: float = 0.0
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def phases(self) -> dict[str, float]:
        """Seconds spent in each of :data:`PHASES`."""
        bounds = [
            self.failure_at,
            self.declared_at,
            self.group_formed_at,
            self.restored_at,
            self.first_step_at,
        ]
        return {name: bounds[i + 1] - bounds[i] for i, name in enumerate(PHASES)}

    @property
    def total_s(self) -> float:
        return self.first_step_at - self.failure_at

    @property
    def steps_rerun(self) -> int:
        """Completed steps that had to be trained again (restored from an older state)."""
        return max(0, self.step - self.restored_step)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["phases"] = {k: round(v, 6) for k, v in self.phases.items()}
        out["total_s"] = round(self.total_s, 6)
        return out


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
