"""Worker output read from this machine's files, without etcd: ``ringmaster logs`` after ``run``.

Every node agent keeps its workers' output in rotated files on its machine
(:mod:`agents.node.log_files`, under ``RINGMASTER_LOG_DIR``).  ``ringmaster
run`` starts its agents on this machine and, without ``--etcd``, an etcd that
ends with the run: once the run is over, the hints it printed
(``see `ringmaster logs <job>```) could reach no etcd.  Given no etcd,
``ringmaster logs`` reads those files instead: every node of the job that ran
here, merged by time.  Runs in the CLI.
"""

from __future__ import annotations

import heapq
import os
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

from agents.node.log_files import default_root, read_after, read_tail
from orchestrator.api import JobNotFoundError
from orchestrator.observe.logs import LogLine, UnknownNodeError
from orchestrator.state import keys

__all__ = ["iter_local_logs", "local_job_dir", "local_nodes"]

#: Bytes read from a worker's files at a time.
PAGE_BYTES = 1024 * 1024


def local_job_dir(job: str, root: Path | None = None) -> Path:
    """Where this machine's agents keep the job's output."""
    return (root or default_root()) / keys.segment(job, "job name")


def local_nodes(job: str, root: Path | None = None) -> list[str]:
    """The nodes of ``job`` whose agents ran on this machine, sorted."""
    base = local_job_dir(job, root)
    try:
        return sorted(e.name for e in os.scandir(base) if e.is_dir())
    except FileNotFoundError:
        return []


def _workers(directory: Path) -> list[int]:
    try:
        return sorted(int(e.name) for e in os.scandir(directory) if e.name.isdigit())
    except FileNotFoundError:
        return []


def _pages(node: str, rank: int, directory: Path) -> Iterator[LogLine]:
    after: int | None = None
    while True:
        page = read_after(directory, after, PAGE_BYTES)
        yield from (LogLine(t, node, rank, text) for t, text in page.lines)
        if not page.lines or page.next == after:
            return
        after = page.next


def iter_local_logs(
    job: str, *, node: str | None = None, tail: int | None = None, root: Path | None = None
) -> Iterator[LogLine]:
    """The job's lines kept on this machine (of ``node`` only, the last ``tail``), oldest
    first.  A worker restarted under the same local rank (a new generation, a new run of
    the job) continues the same files.

    Raises:
        JobNotFoundError: no agent of the job kept output on this machine.
        UnknownNodeError: none of ``node``'s.
    """
    base = local_job_dir(job, root)
    nodes = local_nodes(job, root)
    if not nodes:
        raise JobNotFoundError(
            f"no output of job '{job}' on this machine (looked in {base}) and no etcd given: "
            "pass --etcd host:port or set RINGMASTER_ETCD for a job that runs elsewhere"
        )
    if node is not None and node not in nodes:
        raise UnknownNodeError(
            f"job '{job}' kept no output of a node named '{node}' on this machine (its nodes "
            f"here: {', '.join(nodes)})"
        )
    streams: list[Iterable[LogLine]] = []
    for name in [node] if node is not None else nodes:
        for rank in _workers(base / name):
            directory = base / name / str(rank)
            if tail:
                page = read_tail(directory, tail, PAGE_BYTES)
                streams.append([LogLine(t, name, rank, text) for t, text in page.lines])
            else:
                streams.append(_pages(name, rank, directory))
    lines = heapq.merge(*streams, key=lambda x: x.time)
    yield from deque(lines, maxlen=tail) if tail else lines
