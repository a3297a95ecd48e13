"""The per-job event log in etcd: what happened, when, and why.

Events are :class:`~orchestrator.state.records.Event` records under
``/ringmaster/jobs/<job>/events/<ns>-<source>`` (the key sorts by time).
The controller and agents append; ``ringmaster events`` and the status view
read.  A job keeps its newest :data:`~orchestrator.state.keys.EVENTS_KEPT` events:
an append deletes the oldest beyond that (in batches of :data:`TRIM_SLACK`,
and without reading the log: etcd counts the keys).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys, records
from orchestrator.state.records import Event
from orchestrator.state.runs import list_runs, run_window

__all__ = ["Event", "emit", "entry", "list_events", "record", "trim"]

log = logging.getLogger(__name__)

#: Events beyond :data:`~orchestrator.state.keys.EVENTS_KEPT` before the oldest are
#: deleted, so deletions come a batch at a time rather than one per append.
TRIM_SLACK = keys.EVENTS_KEPT // 10


def record(client: EtcdClient, job: str, event: Event) -> None:
    """Append ``event`` to the log of ``job``, dropping the oldest beyond the bound."""
    key, value = entry(job, event)
    client.put(key, value)
    trim(client, job)


def entry(job: str, event: Event) -> tuple[str, str]:
    """The key and value that append ``event`` to the log of ``job`` (for a write that
    puts it together with other keys, then calls :func:`trim`)."""
    return keys.job_events(job) + f"{time.time_ns():020d}-{event.source}", event.encode()


def trim(client: EtcdClient, job: str) -> None:
    """Drop the oldest events of ``job`` beyond the bound."""
    client.keep_newest(keys.job_events(job), keys.EVENTS_KEPT, TRIM_SLACK)


def emit(client: EtcdClient, job: str, type: str, message: str, **data: Any) -> Event:
    """Append an event (from the controller unless ``source=`` says who); returns it."""
    source = str(data.pop("source", "controller"))
    event = Event(type=type, message=message, source=source, data=data)
    record(client, job, event)
    return event


def list_events(client: EtcdClient, job: str, run: int | None = None) -> list[Event]:
    """Every event of ``job`` (of one ``run`` of it, when given), oldest first.

    An entry that is not an event (written by something else, or by a newer
    ringmaster) is left out with a warning naming its key: one bad entry never
    hides the rest of the log.

    Raises:
        JobNotFoundError: ``run`` is not a run of the job.
    """
    window = None
    if run is not None:
        window = run_window(list_runs(client, job), run)
    out = []
    for kv in client.get_prefix(keys.job_events(job)):
        try:
            out.append(records.decode(Event, kv.value, kv.key))
        except records.RecordError as e:
            log.warning("skipping an event that cannot be read: %s", e)
    if window is not None:
        out = [e for e in out if window[0] <= e.time < window[1]]
    return out
