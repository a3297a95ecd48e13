"""Keeps etcd's history short: compacts it every few seconds while a controller leads.

etcd keeps every old version of every key until its history is compacted.
Its own compactor in revision mode (what the embedded etcd and
``k8s/etcd.yaml`` set) runs once every 5 minutes, a fixed interval in etcd
3.5, so the database holds at least 5 minutes of writes: at 1,000 nodes each
writing a 5 KB progress record every second, about 1.4 GiB.  The leading
controller therefore compacts too, every ``RINGMASTER_ETCD_COMPACT_EVERY``
seconds, keeping the newest ``RINGMASTER_ETCD_HISTORY_REVISIONS`` revisions
(what a paged read or a watch that falls behind needs to finish where it
started); the history held is then that many revisions plus the writes of
one interval.  Compacting frees space inside the database for later writes;
the file keeps its size (``etcdctl defrag`` returns it).

:func:`compaction_target` decides, :class:`HistoryCompactor` does it.
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
from orchestrator.settings import SETTINGS

log = logging.getLogger("ringmaster.etcd.compactor")


def compaction_target(current: int, compacted: int, keep: int) -> int | None:
    """The revision to compact up to, or None when there is nothing to drop.

    Args:
        current: etcd's current revision.
        compacted: the revision compacted up to so far (0: none known).
        keep: revisions of history to keep.
    """
    target = current - keep
    return target if target > compacted else None


class HistoryCompactor:
    """Compacts etcd's history every ``every``, keeping the newest ``keep`` revisions.

    Args:
        client: the controller's client.
        every: time between compactions (``RINGMASTER_ETCD_COMPACT_EVERY``; 0: never).
        keep: revisions kept (``RINGMASTER_ETCD_HISTORY_REVISIONS``).
    """

    def __init__(
        self,
        client: EtcdClient,
        every: timedelta | None = None,
        keep: int | None = None,
    ) -> None:
        self.client = client
        self.every = SETTINGS.etcd_compact_every if every is None else every
        self.keep = SETTINGS.etcd_history_revisions if keep is None else keep
        #: the revision compacted up to by this compactor (0: none yet)
        self.compacted = 0

    def compact_once(self) -> int | None:
        """Compact now if there is history to drop; the revision compacted up to, or None."""
        target = compaction_target(self.client.current_revision(), self.compacted, self.keep)
        if target is None:
            return None
        # already compacted past it (by etcd's own compactor, or another controller)
        with contextlib.suppress(EtcdCompactedError):
            self.client.compact(target)
        self.compacted = target
        return target

    def run(self, stop: threading.Event, leading: Callable[[], bool] = lambda: True) -> None:
        """Compact every ``every`` until ``stop``, in the rounds where ``leading()`` holds."""
        if self.every.total_seconds() <= 0:
            return
        while not stop.wait(self.every.total_seconds()):
            if not leading():
                continue
            try:
                self.compact_once()
            except EtcdError as e:  # etcd away or refusing: the next round tries again
                log.debug("compaction skipped: %s", e)
