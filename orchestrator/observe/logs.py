"""Worker output kept in etcd, for ``ringmaster logs``.

Each node agent reads its workers' stdout and stderr, passes the bytes on to
its own output (so a local run still shows them live) and ships them to etcd
in chunks (:class:`agents.log_shipper.LogShipper`), one
:class:`~orchestrator.records.LogChunk` per key::

    /ringmaster/jobs/<job>/logs/<node>/<local_rank>/<time_ns>

Chunks are not leased: the output of a node that died is what the person on
call wants to read.  Each worker keeps only its most recent output (a byte
budget per worker process), so etcd is never used as a log archive; ship
logs to a real log store for that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from orchestrator import keys, records
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.kv import KeyValue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogLine:
    """One line a worker printed."""

    time: float
    node: str
    local_rank: int
    text: str

    @property
    def worker(self) -> str:
        return f"{self.node}/{self.local_rank}"


def _decode(kv: KeyValue) -> list[LogLine]:
    try:
        chunk = records.decode(records.LogChunk, kv.value, kv.key)
    except records.RecordError as e:
        # written by something else (or by a newer ringmaster): not lines to show
        log.warning("skipping a log chunk that cannot be read: %s", e)
        return []
    return [LogLine(t, chunk.node, chunk.local_rank, text) for t, text in chunk.lines]


def _prefix(job: str, node: str | None) -> str:
    return keys.node_logs(job, node) if node else keys.job_logs(job)


def read_logs(
    client: EtcdClient, job: str, *, node: str | None = None, tail: int | None = None
) -> list[LogLine]:
    """Every stored line of the job (or of one node), oldest first; the last ``tail`` only."""
    lines = [line for kv in client.get_prefix(_prefix(job, node)) for line in _decode(kv)]
    lines.sort(key=lambda line: line.time)
    return lines[-tail:] if tail else lines


def follow_logs(
    client: EtcdClient,
    job: str,
    stop: threading.Event,
    *,
    node: str | None = None,
    tail: int | None = None,
) -> Iterator[LogLine]:
    """The stored lines (the last ``tail``), then new ones as they arrive, until ``stop``."""
    stored = client.get_prefix(_prefix(job, node))
    seen = {kv.key for kv in stored}
    lines = sorted((line for kv in stored for line in _decode(kv)), key=lambda x: x.time)
    yield from lines[-tail:] if tail else lines
    start = max((kv.mod_revision for kv in stored), default=0) + 1
    watch = client.watch(_prefix(job, node), prefix=True, start_revision=start)

    def cancel_on_stop() -> None:
        stop.wait()
        watch.cancel()

    threading.Thread(target=cancel_on_stop, daemon=True).start()
    try:
        for ev in watch:
            if ev.value is None or ev.key in seen:
                continue
            seen.add(ev.key)
            yield from _decode(KeyValue(ev.key, ev.value, ev.mod_revision, 0, 0, 0))
    finally:
        stop.set()
        watch.cancel()
