"""What a person and the controller read from etcd, timed and weighed.

:func:`time_commands` times the library calls behind ``ringmaster status``,
``status`` (every job), ``events`` and ``logs`` (the calls each command makes,
on a connected client: the connection itself is not the control plane's
cost).  :func:`range_sizes` weighs the range reads the controller makes every
tick and the ones those commands make: the size of the response etcd sends
for each, counted page by page so that a response larger than gRPC's
receive limit is weighed too.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from etcd3 import utils as etcd_utils

from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.logs import check_target, read_logs
from orchestrator.state import events, jobs, keys

#: Lines ``ringmaster logs --tail`` asks for in the probe.
TAIL = 100
#: Keys per page when weighing a range.
PAGE = 1000


def commands(client: EtcdClient, job: str, node: str) -> dict[str, Callable[[], Any]]:
    """The reads of each command, as the CLI makes them (``orchestrator/cli``)."""

    def events_cmd() -> Any:
        if client.get(keys.job_spec(job)) is None:
            raise jobs.JobNotFoundError(job)
        return events.list_events(client, job)

    def logs_cmd() -> Any:
        check_target(client, job, None)
        return read_logs(client, job, tail=TAIL)

    def logs_node_cmd() -> Any:
        check_target(client, job, node)
        return read_logs(client, job, node=node, tail=TAIL)

    return {
        "status": lambda: jobs.read_status(client, job),
        "status_all": lambda: jobs.list_jobs(client),
        "events": events_cmd,
        "logs": logs_cmd,
        "logs_node": logs_node_cmd,
    }


def time_commands(
    client: EtcdClient, job: str, node: str, repeats: int = 3
) -> dict[str, dict[str, Any]]:
    """Milliseconds of each command's reads (``repeats`` times); an error is kept as text."""
    out: dict[str, dict[str, Any]] = {}
    for name, fn in commands(client, job, node).items():
        samples: list[float] = []
        error = ""
        for _ in range(repeats):
            started = time.perf_counter()
            try:
                fn()
            except Exception as e:  # a command that fails at this scale is a finding
                error = f"{type(e).__name__}: {e}"[:300]
                break
            samples.append((time.perf_counter() - started) * 1000)
        out[name] = {"ms": samples, "error": error}
    return out


def merge(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Median and maximum milliseconds of each command over several rounds."""
    out: dict[str, dict[str, Any]] = {}
    for name in rounds[0] if rounds else []:
        samples = [ms for r in rounds for ms in r[name]["ms"]]
        errors = [r[name]["error"] for r in rounds if r[name]["error"]]
        out[name] = {
            "median_ms": round(statistics.median(samples), 1) if samples else None,
            "max_ms": round(max(samples), 1) if samples else None,
            "error": errors[0] if errors else "",
        }
    return out


def weigh(client: EtcdClient, prefix: str, single: bool = False) -> dict[str, Any]:
    """Keys under ``prefix`` (or the one key), the bytes of the response that reads them,
    and the largest of them (key and value: about what the put that wrote it carried)."""
    if single:
        resp = client.transport.call(lambda c: c.get_response(prefix))
        largest = max((len(kv.key) + len(kv.value) for kv in resp.kvs), default=0)
        return {
            "keys": len(resp.kvs),
            "bytes": resp.ByteSize(),
            "largest": largest,
            "largest_key": prefix,
        }
    end = etcd_utils.prefix_range_end(prefix.encode())
    start = prefix.encode()
    total, count, header, largest, largest_key = 0, 0, 0, 0, ""

    def page(c: Any, first: bytes) -> Any:
        return c.get_range_response(first, end, sort_order="ascend", limit=PAGE)

    while True:
        resp = client.transport.call(functools.partial(page, first=start))
        header = resp.header.ByteSize() + 2
        for kv in resp.kvs:
            size = kv.ByteSize()
            total += size + 1 + _varint_len(size)  # field tag and length of each kv
            if len(kv.key) + len(kv.value) > largest:
                largest, largest_key = len(kv.key) + len(kv.value), kv.key.decode()
        count += len(resp.kvs)
        if not resp.more or not resp.kvs:
            break
        start = bytes(resp.kvs[-1].key) + b"\x00"
    # + the count field
    return {
        "keys": count,
        "bytes": total + header + 4,
        "largest": largest,
        "largest_key": largest_key,
    }


def _varint_len(n: int) -> int:
    length = 1
    while n >= 0x80:
        n >>= 7
        length += 1
    return length


def range_sizes(client: EtcdClient, job: str, generation: int) -> dict[str, dict[str, Any]]:
    """The response of each range read of the controller's tick and of the commands."""
    return {
        # WorldReader.read, every tick
        "controller:progress": weigh(client, keys.job_progress(job)),
        "controller:node_progress": weigh(client, keys.job_node_progress(job)),
        "controller:nodes": weigh(client, keys.job_nodes(job)),
        "controller:reports": weigh(client, keys.job_reports(job, generation)),
        "controller:node_reports": weigh(client, keys.job_node_reports(job, generation)),
        "controller:done": weigh(client, keys.job_done(job)),
        "controller:commands": weigh(client, keys.job_commands(job)),
        "controller:plan": weigh(client, keys.job_plan(job), single=True),
        "controller:status": weigh(client, keys.job_status(job), single=True),
        "controller:recoveries": weigh(client, keys.job_recoveries(job)),
        # the commands
        "status_all:jobs": weigh(client, keys.jobs_prefix()),
        "events:events": weigh(client, keys.job_events(job)),
        "logs:logs": weigh(client, keys.job_logs(job)),
    }


def tick_cost(client: EtcdClient, job: str, repeats: int = 3) -> dict[str, float]:
    """Milliseconds of the two halves of a controller tick, repeated read-only here.

    ``read``: :meth:`WorldReader.read <orchestrator.controller.world.WorldReader.read>`
    (every range read and the decoding of every record); ``decide``: the pure
    policy on that snapshot.  Nothing is applied: the serving controller does that.
    """
    from orchestrator.controller import policy
    from orchestrator.controller.world import WorldReader

    spec, _ = jobs.read_spec(client, job)
    status = jobs.read_status(client, job)
    assert status is not None
    reader = WorldReader(client, job)
    reads, decides = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        world = reader.read()
        middle = time.perf_counter()
        policy.decide(spec, policy.Memory(), status, world)
        reads.append((middle - started) * 1000)
        decides.append((time.perf_counter() - middle) * 1000)
    return {"read_ms": statistics.median(reads), "decide_ms": statistics.median(decides)}
