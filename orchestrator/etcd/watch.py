"""Following a key (or a prefix) in etcd through outages: the one watch loop of ringmaster.

A watch of etcd ends whenever its stream breaks: a member killed, quorum lost,
the process cut off.  :class:`KeyFollower` watches again, from the revision
after the last one it handed on (``start_revision = seen + 1``), so a change
made while no watch ran arrives once, in order, when the stream is back: not
missed, not repeated.  It reads the key itself only when it has nothing to
resume from: at the first start (what is stored then), and after etcd
compacted away the revisions it was to resume from (then what is stored now
stands for the changes it can no longer be told about; a key deleted in
between is not reported).  Each read is at one revision, and the watch starts
right after it.  A follower that only needs to know *that* something changed
(the controller, woken by changes under every job) reads no values: its read
learns the revision to start from, and ``on_read`` tells it that changes may
have gone untold.  A follower that already read what is stored (and shows it
itself) starts with ``start_after``, the revision of its read.  ``on_error``
and ``on_watch`` tell whoever shows the changes to a person when the watch is
lost and when it runs again.

It runs in a daemon thread of whichever process follows a key: a worker
(:mod:`agents.runtime.plan_watch`), a node agent (its commands and the plan),
the controller (its wake-ups, :mod:`orchestrator.controller.service`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.diagnosis import EtcdCompactedError
from orchestrator.etcd.kv import KeyValue, Watch, WatchEvent

__all__ = ["RETRY_PAUSE", "KeyFollower", "WatchEndedError"]

log = logging.getLogger(__name__)

#: Pause between a watch that ended (etcd away) and the next attempt.
RETRY_PAUSE = timedelta(seconds=0.5)


class WatchEndedError(EtcdError):
    """A watch's stream ended without an error (closed by etcd, or cancelled elsewhere)."""


class KeyFollower:
    """Hands every change of ``key`` (or under it) to ``handle``, until stopped.

    ``handle`` is called in the follower's thread, one event at a time, in
    revision order: first with what is stored at the start (one event per key,
    at its ``mod_revision``), then with every put and every delete (``value``
    None) after it.  An error it raises is logged and the event counts as
    handed on.

    Args:
        client: the client to read and watch with.
        key: the key, or with ``prefix`` the prefix, to follow.
        handle: takes each event.
        prefix: follow every key under ``key``.
        values: a read hands on what is stored; False: a read learns only the
            revision to watch from (nothing is handed on for it).
        on_read: called after each read (the first, and after a compaction),
            once what it found was handed on.
        on_error: called with what ended a read or a watch (etcd away, a
            broken stream, a compaction), before the follower tries again;
            :attr:`revision` is then where it resumes (None: it reads first).
        on_watch: called with the start revision each time a watch runs.
        start_after: the revision of a read the caller made itself: the
            follower watches from the one after it instead of reading first.
        stop: an event that ends the following once set (default: its own;
            :meth:`stop` sets it and cancels the watch at once).
        retry_pause: wait between a watch that ended and the next.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        handle: Callable[[WatchEvent], object],
        *,
        prefix: bool = False,
        values: bool = True,
        on_read: Callable[[], object] | None = None,
        on_error: Callable[[Exception], object] | None = None,
        on_watch: Callable[[int], object] | None = None,
        start_after: int | None = None,
        stop: threading.Event | None = None,
        retry_pause: timedelta = RETRY_PAUSE,
    ) -> None:
        self.client = client
        self.key = key
        self.prefix = prefix
        self._handle = handle
        self._values = values
        self._on_read = on_read
        self._on_error = on_error
        self._on_watch = on_watch
        self._stop = stop if stop is not None else threading.Event()
        self._pause = retry_pause.total_seconds()
        self._lock = threading.Lock()
        self._watch: Watch | None = None
        self._thread: threading.Thread | None = None
        #: the revision of the last event handed on (or of the last read); None
        #: before the first read and after a compaction: read the key next
        self.revision: int | None = start_after

    def start(self, name: str | None = None) -> KeyFollower:
        """Follow in a daemon thread (named ``name``, default after the key); returns self."""
        self._thread = threading.Thread(
            target=self.run, name=name or f"follow {self.key}", daemon=True
        )
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread :meth:`start` started to end; True when it has (or none ran)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def stop(self) -> None:
        """Stop following: the thread ends without handing on anything more."""
        self._stop.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            with contextlib.suppress(Exception):
                watch.cancel()

    def run(self) -> None:
        """Follow in this thread until stopped (what :meth:`start` runs)."""
        while not self._stop.is_set():
            try:
                if self.revision is None:
                    self._read()
                if self.revision is not None:  # None: stopped during the read
                    self._follow_from(self.revision + 1)
            except EtcdCompactedError as e:
                log.info("watch of %s resumes with a read: %s", self.key, e)
                self.revision = None
                self._tell(e)
                continue  # not an outage: read and watch again at once
            except Exception as e:  # etcd went away, or the stream broke
                log.debug("watch of %s ended (resuming): %s", self.key, e)
                self._tell(e)
            self._stop.wait(self._pause)

    def _tell(self, e: Exception) -> None:
        if self._on_error is None or self._stop.is_set():
            return
        try:
            self._on_error(e)
        except Exception:
            log.exception("reporting the end of a watch of %s failed", self.key)

    def _read(self) -> None:
        """Hand on what is stored now; the watch resumes right after the read's revision."""
        found: list[KeyValue] = []
        if not self._values:
            revision = self.client.current_revision()
        elif self.prefix:
            found, revision = self.client.get_prefix_with_revision(self.key)
        else:
            kv, revision = self.client.get_with_revision(self.key)
            found = [kv] if kv is not None else []
        for kv in found:
            if self._stop.is_set():
                return
            self._hand_on(WatchEvent(kv.key, kv.value, kv.mod_revision))
        self.revision = revision
        if self._on_read is not None:
            try:
                self._on_read()
            except Exception:
                log.exception("handling a read of %s failed", self.key)

    def _follow_from(self, start_revision: int) -> None:
        """Watch from ``start_revision`` until the stream ends or the follower stops."""
        watch = self.client.watch(self.key, prefix=self.prefix, start_revision=start_revision)
        with self._lock:
            self._watch = watch
        try:
            if self._stop.is_set():
                return
            if self._on_watch is not None:
                try:
                    self._on_watch(start_revision)
                except Exception:
                    log.exception("reporting a watch of %s failed", self.key)
            for event in watch:
                if self._stop.is_set():
                    return
                self._hand_on(event)
                self.revision = event.mod_revision
            if not self._stop.is_set():
                raise WatchEndedError(f"the watch of {self.key} ended without an error")
        finally:
            with self._lock:
                self._watch = None
            with contextlib.suppress(Exception):  # a broken stream has nothing to cancel
                watch.cancel()

    def _hand_on(self, event: WatchEvent) -> None:
        try:
            self._handle(event)
        except Exception:
            log.exception("handling a change of %s failed", event.key)
