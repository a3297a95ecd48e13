"""A job's training curve in etcd: step, throughput and loss sampled over time.

The controller appends one :class:`~orchestrator.observe.records.HistorySample` every
:data:`SAMPLE_EVERY` while the job runs, one key per sample under
``/ringmaster/jobs/<job>/history/``.  The history is bounded: past
:data:`MAX_SAMPLES` keys, every other sample of the older half is dropped, so
a long job keeps its whole time span at a coarser resolution and etcd never
holds more than ``MAX_SAMPLES`` of them.  ``ringmaster report`` reads it back.
"""

from __future__ import annotations

import time

from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.records import HistorySample
from orchestrator.settings import SETTINGS
from orchestrator.state import keys, records
from orchestrator.state.runs import list_runs, run_window

#: How often the controller samples a running job.
SAMPLE_EVERY = SETTINGS.history_every
#: Most samples kept per job.
MAX_SAMPLES = SETTINGS.history_max


class HistoryWriter:
    """Appends samples for one job and keeps the history bounded."""

    def __init__(self, client: EtcdClient, job: str, max_samples: int = MAX_SAMPLES) -> None:
        if max_samples < 4:
            raise ValueError(f"max_samples must be at least 4, got {max_samples}")
        self.client = client
        self.job = job
        self.max_samples = max_samples
        self._count: int | None = None
        self._last = 0.0

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self._last >= SAMPLE_EVERY.total_seconds()

    def append(self, sample: HistorySample) -> None:
        self._last = time.monotonic()
        key = keys.job_history(self.job) + f"{time.time_ns():020d}"
        records.write(self.client, key, sample)
        if self._count is None:
            self._count = len(self.client.get_prefix(keys.job_history(self.job)))
        else:
            self._count += 1
        if self._count > self.max_samples:
            self._thin()

    def _thin(self) -> None:
        entries = self.client.get_prefix(keys.job_history(self.job))
        older = entries[: len(entries) // 2]
        for kv in older[1::2]:
            self.client.delete(kv.key)
        self._count = len(entries) - len(older[1::2])


def read_history(client: EtcdClient, job: str, run: int | None = None) -> list[HistorySample]:
    """Every stored sample of ``job`` (of one ``run`` of it, when given), oldest first.

    Raises:
        JobNotFoundError: ``run`` is not a run of the job.
    """
    out = sorted(
        records.read_all(client, keys.job_history(job), HistorySample).values(),
        key=lambda s: s.time,
    )
    if run is None:
        return out
    start, end = run_window(list_runs(client, job), run)
    return [s for s in out if start <= s.time < end]
