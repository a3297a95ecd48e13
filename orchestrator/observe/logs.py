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

from orchestrator import jobs, keys, records
from orchestrator.api import OrchestratorError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.kv import KeyValue
from orchestrator.jobs import list_runs, run_window

log = logging.getLogger(__name__)


class UnknownNodeError(OrchestratorError):
    """Logs were asked for a node that the job does not have and never had."""


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


def job_nodes(client: EtcdClient, job: str) -> list[str]:
    """Every node the job has or had, sorted: with stored output, registered, or in its status."""
    found: set[str] = set()
    for prefix in (keys.job_logs(job), keys.job_nodes(job)):
        found.update(kv.key[len(prefix) :].split("/", 1)[0] for kv in client.get_prefix(prefix))
    status = jobs.read_status(client, job)
    if status is not None:
        found.update(status.active_nodes + status.spare_nodes + status.failed_nodes)
    return sorted(n for n in found if n)


def check_target(client: EtcdClient, job: str, node: str | None = None) -> None:
    """Make sure there is something to read logs of: the job, and ``node`` of it when given.

    Raises:
        JobNotFoundError: nothing was submitted under ``job``.
        UnknownNodeError: the job never had ``node``; the message names the
            nodes it has.
    """
    if jobs.read_status(client, job) is None and client.get(keys.job_spec(job)) is None:
        raise jobs.JobNotFoundError(f"no job named '{job}'")
    if node is None:
        return
    known = job_nodes(client, job)
    if node in known:
        return
    have = f"its nodes: {', '.join(known)}" if known else "it has no nodes yet"
    raise UnknownNodeError(f"job '{job}' has no node named '{node}' ({have})")


def _prefix(job: str, node: str | None) -> str:
    return keys.node_logs(job, node) if node else keys.job_logs(job)


def read_logs(
    client: EtcdClient,
    job: str,
    *,
    node: str | None = None,
    tail: int | None = None,
    run: int | None = None,
) -> list[LogLine]:
    """Every stored line of the job (or of one node, or of one run), oldest first.

    ``tail`` keeps the last lines only.

    Raises:
        JobNotFoundError: ``run`` is not a run of the job.
    """
    lines = [line for kv in client.get_prefix(_prefix(job, node)) for line in _decode(kv)]
    lines.sort(key=lambda line: line.time)
    if run is not None:
        start, end = run_window(list_runs(client, job), run)
        lines = [line for line in lines if start <= line.time < end]
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
