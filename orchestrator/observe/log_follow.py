"""``ringmaster logs --follow``: the workers' output so far, then new lines as they come.

Runs in the CLI's process.  New lines are read from the nodes' agents (a page
after the position each worker was read up to); the tails kept in etcd (a
worker of a node whose agent is gone exited) come by the one watch of
ringmaster, :class:`~orchestrator.etcd.watch.KeyFollower`.  A lost watch (a
member down, a broken stream, a reconnect) resumes right after the last
revision seen, so no tail is missed or shown twice; the person following gets
one note per loss, and a clear error when etcd refuses the watch for good.
The sources and the reads are those of :mod:`orchestrator.observe.logs`.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from orchestrator.api import EtcdAuthError, OrchestratorError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.diagnosis import (
    EtcdCompactedError,
    auth_refusal,
    grpc_error,
    reason,
    token_rejected,
)
from orchestrator.etcd.kv import KeyValue, WatchEvent
from orchestrator.etcd.watch import KeyFollower
from orchestrator.observe.logs import (
    PAGE_BYTES,
    LogLine,
    Notes,
    Worker,
    _Agent,
    _decode,
    _find_sources,
    _note,
    _page_limit,
    _pages,
    _prefix,
    _tails,
)
from orchestrator.ports.api import AgentUnreachableError, RequestError

__all__ = ["FOLLOW_POLL", "FOLLOW_RESCAN", "LogFollowError", "follow_logs"]

log = logging.getLogger(__name__)

#: Seconds between reads of new lines, and between looks for new workers and nodes.
FOLLOW_POLL = 0.5
FOLLOW_RESCAN = 5.0


class LogFollowError(OrchestratorError):
    """Following the logs cannot go on: etcd refused the watch for good."""


class _Follower:
    """The state of ``follow_logs``: where each worker was read up to, and what was shown."""

    def __init__(self, client: EtcdClient, job: str, node: str | None, notes: Notes | None):
        self.client, self.job, self.node, self.notes = client, job, node, notes
        self.cursors: dict[Worker, int] = {}
        self.agents: dict[Worker, _Agent] = {}
        #: per worker, the time of the newest line shown (a tail in etcd may repeat them)
        self.shown: dict[Worker, float] = {}

    def shown_now(self, lines: Iterable[LogLine]) -> list[LogLine]:
        """``lines`` (read once each, from an agent's files) in time order, now marked shown."""
        out = sorted(lines, key=lambda x: x.time)
        for line in out:
            worker = (line.node, line.local_rank)
            self.shown[worker] = max(line.time, self.shown.get(worker, float("-inf")))
        return out

    def fresh(self, lines: Iterable[LogLine]) -> list[LogLine]:
        """The lines of tails from etcd not shown yet (newer than the worker's last shown),
        each once (a tail written again repeats the lines it kept)."""
        last = dict(self.shown)
        return self.shown_now(
            {x for x in lines if x.time > last.get((x.node, x.local_rank), float("-inf"))}
        )

    def rescan(self) -> None:
        """Look for workers and nodes that came since (their output is read from the start)."""
        try:
            sources = _find_sources(self.client, self.job, self.node, self.notes)
        except Exception as e:  # etcd away for a moment: the agents known still answer
            log.debug("looking for new workers: %s", e)
            return
        for worker, agent in sources.agents.items():
            if worker not in self.agents:
                self.agents[worker] = agent
                self.cursors.setdefault(worker, 0)

    def poll(self) -> list[LogLine]:
        """New lines from every agent followed; a worker whose agent stops answering is dropped."""
        new: list[LogLine] = []
        for worker, agent in list(self.agents.items()):
            after = self.cursors.get(worker)
            while True:
                try:
                    lines, position = agent.read(worker[1], after, PAGE_BYTES)
                except (AgentUnreachableError, RequestError) as e:
                    _note(self.notes, f"{agent.node}: {e}; following what it keeps in etcd")
                    del self.agents[worker]
                    break
                self.cursors[worker] = position
                new += lines
                if not lines or position == after:
                    break
                after = position
        return new


@dataclass(frozen=True)
class _WatchNews:
    """The watch of the tails in etcd ended (``error``), or runs again (``error`` None)."""

    error: Exception | None
    #: the last revision seen: the watch resumes after it (None: it reads the tails again)
    revision: int | None


class _Outage:
    """Tells the person following about a lost watch: one note per loss (and one per
    compaction), and the error to end with when etcd refuses the watch for good."""

    def __init__(self, prefix: str, notes: Notes | None) -> None:
        self.prefix, self.notes = prefix, notes
        self.lost = False
        #: set when following cannot go on: raise it once the lines read are shown
        self.fatal: LogFollowError | None = None

    def saw(self, news: _WatchNews) -> None:
        """Note the first error of a loss, or keep the one that will not heal."""
        error = news.error
        if error is None:
            self.lost = False
            return
        where = f"the etcd watch of {self.prefix}"
        if _permanent(error):
            self.fatal = LogFollowError(
                f"following the logs stopped: etcd refused {where} ({_reason(error)}); "
                "check the etcd user and its role (it needs read access to the job's keys "
                "under /ringmaster/), then run `ringmaster logs --follow` again"
            )
            self.fatal.__cause__ = error
            return
        revision = news.revision
        compacted = isinstance(error, EtcdCompactedError) or revision is None
        if self.lost and not compacted:
            return
        self.lost = True
        if revision is None or compacted:
            then = "reading the tails stored there again (a tail replaced meanwhile is not shown)"
        else:
            then = f"resuming from revision {revision + 1}"
        _note(self.notes, f"{where} was lost ({_reason(error)}); {then}")


def _permanent(e: Exception) -> bool:
    """etcd refused this client (not an outage): following again would fail again."""
    if isinstance(e, EtcdAuthError):
        return True
    err = grpc_error(e)
    if err is None or token_rejected(err):  # a token to renew: the client logs in again
        return False
    return auth_refusal(err, (), None) is not None


def _reason(e: Exception) -> str:
    err = grpc_error(e)
    return reason(err if err is not None else e)


def follow_logs(
    client: EtcdClient,
    job: str,
    stop: threading.Event,
    *,
    node: str | None = None,
    tail: int | None = None,
    notes: Notes | None = None,
    poll: float = FOLLOW_POLL,
    since: float = 0.0,
) -> Iterator[LogLine]:
    """The lines so far (the last ``tail``), then new ones as they come, until ``stop``
    (``since``: only lines written from then on, e.g. the start of a run).

    New lines are read from the agents every ``poll`` seconds; tails stored in
    etcd (a worker of a node whose agent is gone exited) come by a watch
    (:class:`~orchestrator.etcd.watch.KeyFollower`).  A watch lost (etcd away,
    a broken stream) resumes after the last revision seen, so no tail is
    missed or shown twice; ``notes`` gets one line for each loss.

    Raises:
        LogFollowError: etcd refused the watch for good (credentials, role).
    """
    follower = _Follower(client, job, node, notes)
    _, revision = client.get_with_revision(_prefix(job, node))  # the watch starts after it
    sources = _find_sources(client, job, node, notes)
    follower.agents = dict(sources.agents)
    streams: list[Iterable[LogLine]] = list(sources.etcd_only().values())
    if tail and not since:  # the last lines of every source (else: read, then cut)
        streams += _tails(sources, tail, notes, follower.cursors)
    else:
        limit = _page_limit(len(sources.agents))
        streams += [
            _pages(a, rank, limit, notes, follower.cursors)
            for (_, rank), a in sources.agents.items()
        ]
    first = [x for x in heapq.merge(*streams, key=lambda x: x.time) if x.time >= since]
    yield from follower.shown_now(first[-tail:] if tail else first)

    arrived: queue.Queue[LogLine | _WatchNews] = queue.Queue()

    def handle(ev: WatchEvent) -> None:
        if ev.value is not None:
            for line in _decode(KeyValue(ev.key, ev.value, ev.mod_revision, 0, 0, 0)):
                arrived.put(line)

    watch = KeyFollower(
        client,
        _prefix(job, node),
        handle,
        prefix=True,
        start_after=revision,
        on_error=lambda e: arrived.put(_WatchNews(e, watch.revision)),
        on_watch=lambda start: arrived.put(_WatchNews(None, start - 1)),
    )
    watch.start(name="logs-watch")
    outage = _Outage(_prefix(job, node), notes)
    next_scan = time.monotonic() + FOLLOW_RESCAN
    try:
        while not stop.wait(poll):
            if time.monotonic() >= next_scan:
                follower.rescan()
                next_scan = time.monotonic() + FOLLOW_RESCAN
            new = follower.shown_now(follower.poll())
            stored: list[LogLine] = []
            while not arrived.empty():
                item = arrived.get_nowait()
                if isinstance(item, _WatchNews):
                    outage.saw(item)
                elif (item.node, item.local_rank) not in follower.agents and item.time >= since:
                    stored.append(item)
            yield from sorted([*new, *follower.fresh(stored)], key=lambda x: x.time)
            if outage.fatal is not None:
                raise outage.fatal
    finally:
        stop.set()
        watch.stop()
