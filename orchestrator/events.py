"""The per-job event log in etcd: what happened, when, and why.

Events are small JSON records under ``/ringmaster/jobs/<job>/events/<ns>``
(the key sorts by time).  The controller and agents append; ``ringmaster
events`` and the status view read.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator import keys
from orchestrator.etcd.client import EtcdClient


@dataclass
class Event:
    """One entry of a job's event log."""

    type: str
    message: str
    time: float = field(default_factory=time.time)
    source: str = "controller"
    data: dict[str, Any] = field(default_factory=dict)


def record(client: EtcdClient, job: str, event: Event) -> None:
    key = keys.job_events(job) + f"{time.time_ns():020d}-{event.source}"
    client.put(key, json.dumps(asdict(event), sort_keys=True))


def emit(client: EtcdClient, job: str, type: str, message: str, **data: Any) -> Event:
    """Append an event from the controller; returns it."""
    source = str(data.pop("source", "controller"))
    event = Event(type=type, message=message, source=source, data=data)
    record(client, job, event)
    return event


def list_events(client: EtcdClient, job: str) -> list[Event]:
    """Every event of ``job``, oldest first."""
    out = []
    for kv in client.get_prefix(keys.job_events(job)):
        out.append(Event(**json.loads(kv.value)))
    return out
