"""Worker output for ``ringmaster logs``: from the nodes' agents, else the tails kept in etcd.

A worker's output stays on its node: the agent tees it to its own stdout (the
kubelet's log) and writes it to rotated files (:mod:`agents.node.log_files`).  While
the agent lives, its liveness port (the ``liveness`` address of its
registration, :mod:`orchestrator.ports.liveness`) answers reads of those files, each
answer bounded: an index of its workers, a page after a position, the last
lines.  This module asks every agent of the job and merges the lines by time,
each request with the job's port credential, read from etcd
(:mod:`orchestrator.state.port_credential`): an agent answers its workers' output
only to whoever may read the job's keys.

etcd keeps only what a node that is gone can still show: when a worker exits,
its agent stores its last lines (at most ``agents.node.log_shipper.TAIL_LINES`` and
``TAIL_BYTES``) as one :class:`~orchestrator.state.records.LogChunk`::

    /ringmaster/jobs/<job>/logs/<node>/<local_rank>/tail

A worker whose agent answers is read from the agent; any other worker (its
agent gone, unreachable, or without its files) from that tail.  Chunks an
older ringmaster streamed under the same prefix are read the same way.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from orchestrator.api import OrchestratorError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.kv import KeyValue
from orchestrator.ports.api import AgentUnreachableError, RequestError
from orchestrator.ports.liveness import ask
from orchestrator.state import jobs, keys, records
from orchestrator.state.api import PortCredentialError
from orchestrator.state.port_credential import read_token
from orchestrator.state.runs import list_runs, run_window

log = logging.getLogger(__name__)

#: Seconds one request to an agent may take.
AGENT_TIMEOUT = 5.0
#: Agents asked at once.
PARALLEL = 16
#: Bytes of file content per page asked of an agent, and the memory all open pages may use.
PAGE_BYTES = 1024 * 1024
MIN_PAGE_BYTES = 64 * 1024
PAGES_BUDGET = 64 * 1024 * 1024

#: Where notes about the sources go (an agent that did not answer ...): one line each.
Notes = Callable[[str], None]


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


Worker = tuple[str, int]


def _decode(kv: KeyValue) -> list[LogLine]:
    try:
        chunk = records.decode(records.LogChunk, kv.value, kv.key)
    except records.RecordError as e:
        # written by something else (or by a newer ringmaster): not lines to show
        log.warning("skipping a log chunk that cannot be read: %s", e)
        return []
    return [LogLine(t, chunk.node, chunk.local_rank, text) for t, text in chunk.lines]


def job_nodes(client: EtcdClient, job: str) -> list[str]:
    """Every node the job has or had, sorted: with a stored tail, registered, or in its status."""
    found: set[str] = set()
    for prefix in (keys.job_logs(job), keys.job_nodes(job)):
        found.update(client.child_names(prefix))
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


def _stored(kvs: Iterable[KeyValue]) -> dict[Worker, list[LogLine]]:
    """The lines kept in etcd, per worker, oldest first, each line once."""
    out: dict[Worker, set[LogLine]] = {}
    for kv in kvs:
        for line in _decode(kv):
            out.setdefault((line.node, line.local_rank), set()).add(line)
    return {w: sorted(lines, key=lambda x: x.time) for w, lines in out.items()}


def _agents(client: EtcdClient, job: str, node: str | None) -> dict[str, str]:
    """node → address of its agent's port, for the registered nodes (of ``node`` only)."""
    if node is not None:
        kv = client.get(keys.job_node(job, node))
        kvs = [kv] if kv is not None else []
    else:
        kvs = client.get_prefix(keys.job_nodes(job))
    out: dict[str, str] = {}
    for kv in kvs:
        try:
            record = records.decode(records.NodeRecord, kv.value, kv.key)
        except records.RecordError as e:
            log.warning("skipping a registration that cannot be read: %s", e)
            continue
        if record.liveness:
            out[kv.key.rsplit("/", 1)[-1]] = record.liveness
    return out


@dataclass
class _Agent:
    """One node's agent, asked for its workers' files."""

    job: str
    node: str
    address: str
    #: the job's port credential, sent with every request
    token: str = field(default="", repr=False)
    timeout: float = AGENT_TIMEOUT

    def _ask(self, op: str, **args: object) -> dict[str, object]:
        request = {"op": op, "job": self.job, **args}
        return ask(self.address, request, self.timeout, token=self.token)

    def workers(self) -> list[int]:
        index = self._ask("logs.index").get("workers")
        return sorted(int(r) for r in index) if isinstance(index, dict) else []

    def _page(self, answer: dict[str, object], local_rank: int) -> tuple[list[LogLine], int]:
        lines = answer.get("lines")
        lines = lines if isinstance(lines, list) else []
        out = [LogLine(float(t), self.node, local_rank, str(text)) for t, text in lines]
        position = answer.get("next")
        return out, position if isinstance(position, int) else 0

    def tail(self, local_rank: int, count: int) -> tuple[list[LogLine], int]:
        answer = self._ask("logs.tail", local_rank=local_rank, lines=count, limit=PAGE_BYTES)
        return self._page(answer, local_rank)

    def read(self, local_rank: int, after: int | None, limit: int) -> tuple[list[LogLine], int]:
        answer = self._ask("logs.read", local_rank=local_rank, after=after, limit=limit)
        return self._page(answer, local_rank)


@dataclass
class _Sources:
    """Where each worker's lines come from: an agent that answers, else etcd."""

    agents: dict[Worker, _Agent] = field(default_factory=dict)
    stored: dict[Worker, list[LogLine]] = field(default_factory=dict)

    def etcd_only(self) -> dict[Worker, list[LogLine]]:
        return {w: lines for w, lines in self.stored.items() if w not in self.agents}


def _note(notes: Notes | None, text: str) -> None:
    if notes is not None:
        notes(text)


def _find_sources(client: EtcdClient, job: str, node: str | None, notes: Notes | None) -> _Sources:
    """Ask every registered agent for its workers; read the tails in etcd."""
    stored_kvs = client.get_prefix(_prefix(job, node))
    sources = _Sources(stored=_stored(stored_kvs))
    ports = _agents(client, job, node)
    if not ports:
        return sources
    try:
        token = read_token(client, job)
    except PortCredentialError as e:
        _note(notes, f"{e}; showing the last lines kept in etcd")
        return sources
    agents = [_Agent(job, n, address, token) for n, address in ports.items()]

    def index(agent: _Agent) -> tuple[_Agent, list[int]]:
        try:
            return agent, agent.workers()
        except (AgentUnreachableError, RequestError) as e:
            _note(notes, f"{agent.node}: {e}; showing the last lines it kept in etcd")
            return agent, []

    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        for agent, ranks in pool.map(index, agents):
            for rank in ranks:
                sources.agents[(agent.node, rank)] = agent
    return sources


def _pages(
    agent: _Agent,
    local_rank: int,
    limit: int,
    notes: Notes | None,
    cursors: dict[Worker, int] | None = None,
) -> Iterator[LogLine]:
    """Every line of a worker from its agent's files, a page at a time."""
    after: int | None = cursors.get((agent.node, local_rank)) if cursors else None
    while True:
        try:
            lines, position = agent.read(local_rank, after, limit)
        except (AgentUnreachableError, RequestError) as e:
            _note(notes, f"{agent.node}/{local_rank}: {e}; its output stops here")
            return
        if cursors is not None:
            cursors[(agent.node, local_rank)] = position
        yield from lines
        if not lines or position == after:
            return
        after = position


def _tails(
    sources: _Sources, count: int, notes: Notes | None, cursors: dict[Worker, int] | None = None
) -> list[list[LogLine]]:
    """The last ``count`` lines of every worker read from an agent (asked in parallel)."""

    def one(item: tuple[Worker, _Agent]) -> list[LogLine]:
        (node, rank), agent = item
        try:
            lines, position = agent.tail(rank, count)
        except (AgentUnreachableError, RequestError) as e:
            _note(notes, f"{node}/{rank}: {e}")
            return sources.stored.get((node, rank), [])
        if cursors is not None:
            cursors[(node, rank)] = position
        return lines

    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        return list(pool.map(one, sources.agents.items()))


def _page_limit(streams: int) -> int:
    return max(MIN_PAGE_BYTES, min(PAGE_BYTES, PAGES_BUDGET // max(streams, 1)))


def iter_logs(
    client: EtcdClient,
    job: str,
    *,
    node: str | None = None,
    tail: int | None = None,
    run: int | None = None,
    notes: Notes | None = None,
) -> Iterator[LogLine]:
    """The lines of the job (or of one node, or of one run), oldest first.

    ``tail`` keeps the last lines only.  Lines come from the agents a page at
    a time, so the whole output is never held at once (unless ``tail`` is
    given with ``run``).

    Raises:
        JobNotFoundError: ``run`` is not a run of the job.
    """
    window = run_window(list_runs(client, job), run) if run is not None else None
    sources = _find_sources(client, job, node, notes)
    streams: list[Iterable[LogLine]] = list(sources.etcd_only().values())
    if tail and window is None:
        streams += _tails(sources, tail, notes)
    else:
        limit = _page_limit(len(sources.agents))
        streams += [_pages(a, rank, limit, notes) for (_, rank), a in sources.agents.items()]
    lines: Iterator[LogLine] = heapq.merge(*streams, key=lambda x: x.time)
    if window is not None:
        start, end = window
        lines = (line for line in lines if start <= line.time < end)
    if tail:
        yield from deque(lines, maxlen=tail)
    else:
        yield from lines


def read_logs(
    client: EtcdClient,
    job: str,
    *,
    node: str | None = None,
    tail: int | None = None,
    run: int | None = None,
    notes: Notes | None = None,
) -> list[LogLine]:
    """:func:`iter_logs` as a list."""
    return list(iter_logs(client, job, node=node, tail=tail, run=run, notes=notes))
