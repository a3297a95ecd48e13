"""Who writes a checkpoint root: the writer marker, and what a run makes of it (pure).

One live run writes a checkpoint root (``checkpoint.url``) at a time: two
runs of one job with etcds of their own would otherwise resume from each
other's checkpoints while both train.  The run that writes a root keeps a
small marker object in it, :data:`MARKER_NAME`, naming the run's lineage
(:func:`orchestrator.state.runs.lineage_id`), who holds it (the leading
controller's host, process id and etcd endpoints) and a heartbeat time that
the holder renews every :data:`REFRESH_S`.  :func:`judge` decides what
another run makes of a marker it finds:

* none there: the root is **free**;
* the same lineage (a standby controller that took over, a resumed run):
  **ours**, taken at once;
* another lineage whose heartbeat is at most ``stale_after_s`` old (the
  holder's own limit, :data:`STALE_AFTER_S` by default): **live**, the run is
  refused with :func:`refusal`;
* older: **stale** (its holder was SIGKILLed, or lost its machine), taken
  over with a warning (:func:`takeover_note`).

Ages are the reader's wall clock minus the holder's: clocks that disagree by
more than a few seconds shift them (a heartbeat from the future counts as
fresh).  This module does no I/O; :mod:`orchestrator.checkpoint_root.writer_hold` reads and
writes the marker.  It runs in the controller and in the CLI.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from enum import Enum

__all__ = [
    "MARKER_NAME",
    "REFRESH_S",
    "STALE_AFTER_S",
    "Holding",
    "WriterMarker",
    "judge",
    "lost_note",
    "refusal",
    "takeover_note",
]

#: The marker's name in the root (``checkpoints list`` and retention see only ``step-*``).
MARKER_NAME = ".ringmaster-writer.json"

#: Seconds between the holder's heartbeats.
REFRESH_S = 5.0

#: A heartbeat older than this (six missed refreshes) means its holder is gone.
STALE_AFTER_S = 6 * REFRESH_S

_FORMAT = 1


class Holding(str, Enum):
    """What a run makes of the marker it finds in its checkpoint root."""

    FREE = "free"
    OURS = "ours"
    LIVE = "live"
    STALE = "stale"


@dataclass(frozen=True)
class WriterMarker:
    """The content of the marker: which run writes the root, who holds it, since when.

    Attributes:
        run_id: the lineage of the writing run (``<job>@<first submission time>``).
        token: this holder's own random id (two controllers of one lineage differ).
        job: the job's name.
        run: the run number of the job in its etcd.
        host: the holder's host name.
        pid: the holder's process id (the leading controller).
        etcd: the etcd endpoints of the holder's job (where ``ringmaster stop`` reaches it).
        heartbeat_at: the holder's wall-clock time of its last heartbeat.
        acquired_at: when the holder took the root.
        stale_after_s: how old a heartbeat may get before the holder counts as gone.
    """

    run_id: str
    token: str
    job: str
    run: int
    host: str
    pid: int
    etcd: str
    heartbeat_at: float
    acquired_at: float
    stale_after_s: float = STALE_AFTER_S

    def encode(self) -> bytes:
        return json.dumps({"format": _FORMAT, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> WriterMarker:
        """The marker in ``data``; one that cannot be read counts as a long-dead holder's.

        A marker is written whole (a rename or one object upload), so an
        unreadable one is not a write in progress: someone's garbage, which no
        live run renews.
        """
        try:
            raw = json.loads(data.decode())
            return cls(
                run_id=str(raw["run_id"]),
                token=str(raw["token"]),
                job=str(raw["job"]),
                run=int(raw["run"]),
                host=str(raw["host"]),
                pid=int(raw["pid"]),
                etcd=str(raw["etcd"]),
                heartbeat_at=float(raw["heartbeat_at"]),
                acquired_at=float(raw["acquired_at"]),
                stale_after_s=float(raw.get("stale_after_s", STALE_AFTER_S)),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls("(unreadable marker)", "", "?", 0, "?", 0, "", 0.0, 0.0, 0.0)

    def beat(self, now: float) -> WriterMarker:
        """The same marker with a heartbeat at ``now``."""
        return replace(self, heartbeat_at=now)

    @property
    def holder(self) -> str:
        """Who holds the root, in words."""
        where = f"controller pid {self.pid} on host {self.host}"
        return where + (f", etcd {self.etcd}" if self.etcd else "")


def judge(marker: WriterMarker | None, run_id: str | None, now: float) -> Holding:
    """What a run of lineage ``run_id`` makes of ``marker`` at wall-clock time ``now``.

    Args:
        marker: the marker found in the root, or None.
        run_id: the reader's lineage; None for a reader that has none yet (the
            CLI's check before anything starts), for which no marker is ours.
        now: the reader's wall-clock time.
    """
    if marker is None:
        return Holding.FREE
    if run_id is not None and marker.run_id == run_id:
        return Holding.OURS
    return Holding.STALE if now - marker.heartbeat_at > marker.stale_after_s else Holding.LIVE


def _age(marker: WriterMarker, now: float) -> str:
    return f"{max(now - marker.heartbeat_at, 0.0):.1f}s ago"


def refusal(marker: WriterMarker, url: str, now: float) -> str:
    """The one line that refuses a run whose checkpoint root a live run writes."""
    wait = max(marker.stale_after_s - max(now - marker.heartbeat_at, 0.0), 0.0)
    stop = f"`ringmaster stop {marker.job}" + (f" --etcd {marker.etcd}`" if marker.etcd else "`")
    return (
        f"checkpoint.url {url} is being written by another run: {marker.run_id} (run "
        f"{marker.run} of job '{marker.job}', {marker.holder}), last heartbeat {_age(marker, now)}"
        f"; wait for it to end (or for its heartbeat to be {marker.stale_after_s:g}s old, in "
        f"{wait:.0f}s, if it was killed), stop it with {stop}, or give this job another "
        "checkpoint.url"
    )


def takeover_note(marker: WriterMarker, url: str, now: float) -> str:
    """The warning of a run that takes a stale marker over."""
    return (
        f"took over checkpoint.url {url} from run {marker.run_id} ({marker.holder}): its last "
        f"heartbeat was {_age(marker, now)}, past the {marker.stale_after_s:g}s after which its "
        "holder counts as gone (its checkpoints stay where they are)"
    )


def lost_note(marker: WriterMarker, url: str, now: float) -> str:
    """Why a run that held its root stops: another run took the root over."""
    return (
        f"run {marker.run_id} ({marker.holder}) took checkpoint.url {url} over, its heartbeat "
        f"{_age(marker, now)}, while this run could not renew its own: this run stops, so that "
        "one run writes there; check the storage's reachability from this controller"
    )
