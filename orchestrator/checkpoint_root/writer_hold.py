"""Holding a checkpoint root: the writer marker's reads and writes, and the heartbeat.

:class:`MarkerStore` reads and writes
:data:`~orchestrator.checkpoint_root.writer_marker.MARKER_NAME` in a root through
fsspec, as atomically as the store allows: on a local (or NFS) disk a new marker is
linked into place (``link`` fails when the name exists, and the content is whole before
it has a name) and a renewed one is renamed over the old; on S3 a new marker is uploaded
with ``If-None-Match: *`` (s3fs's exclusive create, which AWS S3 and its API-compatible
servers honour) and a renewed one is a plain upload. :class:`WriterHold` takes the root
for a run (what :func:`~orchestrator.checkpoint_root.writer_marker.judge` decides, acted
upon), renews its heartbeat and releases it.

The leading controller holds its job's root (:class:`HeldRoot`, in
:class:`~orchestrator.controller.job.JobController`) from before the job's
first plan to its end, on a thread of its own so that a slow store never
holds up the controller's loop.  ``ringmaster run`` refuses to start at all
when a live run holds the root (:func:`refuse_if_held`) and releases its
run's marker when it ends (:func:`release_root`).  A SIGKILLed holder leaves
its marker behind: it goes stale and the next run takes it over.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import Any

from orchestrator.checkpoint_root.api import RootHeldError
from orchestrator.checkpoint_root.writer_marker import (
    MARKER_NAME,
    REFRESH_S,
    Holding,
    WriterMarker,
    judge,
    lost_note,
    refusal,
    takeover_note,
)

__all__ = [
    "FIRST_WAIT_S",
    "HOLD_WAIT_S",
    "HeldRoot",
    "HoldState",
    "MarkerStore",
    "WriterHold",
    "hold_for",
    "refuse_if_held",
    "release_root",
    "release_store",
    "root_url",
    "shown",
]

log = logging.getLogger("ringmaster.controller")

#: Seconds the controller waits for its store to answer before the job fails for it.
HOLD_WAIT_S = 60.0

#: Seconds a controller's tick waits for the first answer (then it goes on with other jobs).
FIRST_WAIT_S = 5.0

#: How often taking a root is tried again when it changes hands while it is taken.
_ATTEMPTS = 3

_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")


def shown(url: str) -> str:
    """``url`` as messages show it (without a ``user:secret@`` part)."""
    return _USERINFO.sub(r"\1***@", url)


def root_url(url: str, workdir: str) -> str:
    """``checkpoint.url`` as the processes started in ``workdir`` read it: a local
    path (``ckpt``, ``file://./ckpt``) becomes an absolute ``file://`` URL."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    if scheme not in ("file", "local"):
        return url
    return "file://" + os.path.normpath(os.path.join(workdir, os.path.expanduser(rest)))


class MarkerStore:
    """The writer marker of one checkpoint root (see the module docstring).

    Args:
        url: the root (absolute: see :func:`root_url`).
        storage_options: fsspec options (default: the usual AWS/fsspec places).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self._options = storage_options or {}
        self._fs: Any = None
        self.root = ""
        self.local = False

    @property
    def fs(self) -> Any:
        """The root's filesystem, made on first use (by whichever thread uses it first)."""
        if self._fs is None:
            from fsspec.core import url_to_fs

            fs, root = url_to_fs(self.url, **self._options)
            protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
            self.root = str(root).rstrip("/")
            self.local = "file" in protocols or "local" in protocols
            self._fs = fs
        return self._fs

    @property
    def path(self) -> str:
        """The marker's path in the filesystem's own terms."""
        _ = self.fs
        return posixpath.join(self.root, MARKER_NAME)

    def read(self) -> WriterMarker | None:
        """The marker there now, or None."""
        try:
            return WriterMarker.decode(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None

    def create(self, marker: WriterMarker) -> bool:
        """Write ``marker`` unless one is there; False when one was."""
        path = self.path
        if self.local:
            os.makedirs(self.root, exist_ok=True)
            staged = self._staged(marker)
            try:
                os.link(staged, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(staged)
            return True
        try:
            self.fs.pipe_file(path, marker.encode(), mode="create")
        except FileExistsError:
            return False
        return True

    def replace(self, marker: WriterMarker) -> None:
        """Write ``marker`` over whatever is there (whole: a reader never sees half)."""
        path = self.path
        if self.local:
            os.makedirs(self.root, exist_ok=True)
            os.replace(self._staged(marker), path)
        else:
            self.fs.pipe_file(path, marker.encode())

    def delete(self) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass

    def _staged(self, marker: WriterMarker) -> str:
        """A local file with the marker's bytes, synced, beside the marker."""
        staged = f"{self.path}.{secrets.token_hex(4)}.tmp"
        with open(staged, "wb") as f:
            f.write(marker.encode())
            f.flush()
            os.fsync(f.fileno())
        return staged


class WriterHold:
    """One run's hold on its checkpoint root: take it, renew it, release it.

    Args:
        store: the root's marker.
        mine: this holder's marker (its heartbeat is set as it is written).
        clock: wall-clock time (tests pass their own).
    """

    def __init__(
        self, store: MarkerStore, mine: WriterMarker, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.mine = mine
        self.clock = clock

    @property
    def url(self) -> str:
        return shown(self.store.url)

    def acquire(self) -> str | None:
        """Take the root for this run.

        Returns:
            The warning to give when a stale marker was taken over, else None.

        Raises:
            RootHeldError: a live run of another lineage holds the root (the
                message is :func:`~orchestrator.checkpoint_root.writer_marker.refusal`'s line).
        """
        found: WriterMarker | None = None
        for _ in range(_ATTEMPTS):
            now = self.clock()
            found = self.store.read()
            verdict = judge(found, self.mine.run_id, now)
            if verdict is Holding.LIVE:
                assert found is not None
                raise RootHeldError(refusal(found, self.url, now))
            self.mine = replace(self.mine, heartbeat_at=now, acquired_at=now)
            if verdict is Holding.FREE:
                if not self.store.create(self.mine):
                    continue  # another run created one first: judge that one
            else:
                # Ours or stale: read, check, write.  fsspec offers no conditional
                # overwrite, so two runs taking the same stale marker at once both
                # write; reading back tells the one whose write did not last, which
                # then judges the other's (live) marker.  A run that read its own
                # back before the other wrote finds the other's at its next heartbeat
                # and stops (see :meth:`refresh`).
                self.store.replace(self.mine)
            if self._confirmed():
                if verdict is Holding.STALE:
                    assert found is not None
                    return takeover_note(found, self.url, now)
                return None
        now = self.clock()
        found = self.store.read()
        if found is not None and judge(found, self.mine.run_id, now) is Holding.LIVE:
            raise RootHeldError(refusal(found, self.url, now))
        raise RootHeldError(
            f"checkpoint.url {self.url} changed hands {_ATTEMPTS} times while this run took "
            "it: another run is starting on it; start this one again once that one runs, or "
            "give this job another checkpoint.url"
        )

    def _confirmed(self) -> bool:
        current = self.store.read()
        return current is not None and current.token == self.mine.token

    def refresh(self) -> str | None:
        """Renew the heartbeat.

        Returns:
            Why the root is lost (another run took it over, which it does only
            once this holder's heartbeat is stale), or None while it is held.
        """
        now = self.clock()
        found = self.store.read()
        if found is not None and judge(found, self.mine.run_id, now) is not Holding.OURS:
            return lost_note(found, self.url, now)
        self.mine = self.mine.beat(now)
        if found is not None:
            self.store.replace(self.mine)
        elif not self.store.create(self.mine):  # removed by hand, then taken by another run
            found = self.store.read()
            if found is not None and judge(found, self.mine.run_id, now) is not Holding.OURS:
                return lost_note(found, self.url, now)
        return None

    def release(self) -> bool:
        """Remove the marker if it is this holder's own; True if it was removed."""
        return release_store(self.store, self.mine.run_id, self.mine.token)


def release_store(store: MarkerStore, run_id: str, token: str | None = None) -> bool:
    """Remove ``store``'s marker if ``run_id`` holds it (and, given ``token``, this very
    holder: a run that ended does not remove the marker of the next run of its lineage);
    True if it did.

    Only a stale marker is ever taken over, and the holder's own is fresh as it
    releases, so the read and the delete need no condition between them.
    """
    found = store.read()
    if found is None or found.run_id != run_id or token not in (None, found.token):
        return False
    store.delete()
    return True


def refuse_if_held(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Before anything of a run starts: refuse when a live run writes ``url`` (a store
    that cannot be read now is left to the controller, which takes the root before
    the job's first plan and ends the job with the reason).

    Raises:
        RootHeldError: with :func:`~orchestrator.checkpoint_root.writer_marker.refusal`'s line.
    """
    if (found := live_marker(url, storage_options)) is not None:
        raise RootHeldError(refusal(found, shown(url), time.time()))


def live_marker(url: str, storage_options: dict[str, Any] | None = None) -> WriterMarker | None:
    """The marker of the live run that writes ``url`` (None: none, or not readable now)."""
    try:
        found = MarkerStore(url, storage_options).read()
    except Exception as e:  # botocore and aiohttp errors are not all OSErrors
        log.debug("writer marker of %s not read: %s", shown(url), e)
        return None
    live = found is not None and judge(found, None, time.time()) is Holding.LIVE
    return found if live else None


#: Seconds :func:`release_root` waits for the store (a hung one leaves a stale marker).
RELEASE_WAIT = 5.0


def release_root(url: str, run_id: str, wait: float = RELEASE_WAIT) -> None:
    """After a run's processes are gone: remove its marker, if it is still there, waiting
    at most ``wait`` seconds for the store (the run ends anyway; the marker goes stale)."""
    failed: list[BaseException] = [TimeoutError(f"the store did not answer within {wait:g}s")]

    def release() -> None:
        try:
            release_store(MarkerStore(url), run_id)
            failed.clear()
        except Exception as e:
            failed[:] = [e]

    worker = threading.Thread(target=release, name="writer-marker-release", daemon=True)
    worker.start()
    worker.join(wait)
    for error in list(failed):  # a copy: a late answer may still change the list
        log.warning("the writer marker of %s was not removed: %s", shown(url), error)


def hold_for(url: str, run_id: str, job: str, run: int, etcd: str) -> HeldRoot:
    """The hold of the process that leads ``job`` (not started; see :meth:`HeldRoot.start`).

    Args:
        url: the job's checkpoint root (absolute: see :func:`root_url`).
        run_id: the job's lineage (:func:`orchestrator.state.runs.lineage_id`).
        job: the job's name.
        run: the run of the job this process leads.
        etcd: the job's etcd endpoints, comma-separated.
    """
    mine = WriterMarker(
        run_id=run_id,
        token=secrets.token_hex(8),
        job=job,
        run=run,
        host=socket.gethostname(),
        pid=os.getpid(),
        etcd=etcd,
        heartbeat_at=0.0,
        acquired_at=0.0,
    )
    return HeldRoot(WriterHold(MarkerStore(url), mine))


class HoldState(str, Enum):
    """Where a :class:`HeldRoot` stands."""

    PENDING = "pending"
    HELD = "held"
    REFUSED = "refused"
    LOST = "lost"


class HeldRoot:
    """A hold kept by a thread: taken at :meth:`start`, renewed every ``REFRESH_S``.

    The owner reads :attr:`state` (and :attr:`message`: why it is refused or
    lost; :attr:`note`: the takeover's warning) without waiting on the store.
    """

    def __init__(self, hold: WriterHold, refresh_s: float = REFRESH_S) -> None:
        self.hold = hold
        self.refresh_s = refresh_s
        self.message: str | None = None
        self.note: str | None = None
        self.state = HoldState.PENDING
        self.started_at: float | None = None
        self._stop = threading.Event()
        self._settled = threading.Event()
        self._release = False
        self._thread: threading.Thread | None = None

    def start(self, wait: float = 0.0) -> None:
        """Start taking the root, and wait up to ``wait`` seconds for the outcome (the
        first call; later ones return at once)."""
        if self._thread is not None:
            return
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="writer-hold", daemon=True)
        self._thread.start()
        self._settled.wait(wait)

    def close(self, release: bool) -> None:
        """Stop renewing; with ``release`` (which a later close does not undo), remove
        the marker (from the thread)."""
        self._release = self._release or release
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        hold = self.hold
        try:
            self.note = hold.acquire()
        except RootHeldError as e:
            self._end(HoldState.REFUSED, str(e))
            return
        except Exception as e:  # a store that refuses writes, or is not there
            self._end(
                HoldState.REFUSED,
                f"checkpoint.url {hold.url} cannot be written ({type(e).__name__}: {e}), so "
                "no checkpoint could be saved there: check the URL, its permissions and the "
                "credentials, or give this job another checkpoint.url",
            )
            return
        self.state = HoldState.HELD
        self._settled.set()
        failing: type | None = None
        while not self._stop.wait(self.refresh_s):
            try:
                lost = hold.refresh()
            except Exception as e:  # the store is away: renew when it answers again
                if failing is not type(e):
                    log.warning("heartbeat of %s not written: %s", hold.url, e)
                failing = type(e)
                continue
            failing = None
            if lost is not None:
                self._end(HoldState.LOST, lost)
                return
        if self._release:
            try:
                hold.release()
            except Exception as e:  # its marker goes stale
                log.warning("the writer marker of %s was not removed: %s", hold.url, e)

    def _end(self, state: HoldState, message: str) -> None:
        self.message = message
        self.state = state
        self._settled.set()
