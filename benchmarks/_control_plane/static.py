"""The controller's tick and the commands' reads on one snapshot of N x W workers.

What ``--static`` measures where a whole fleet cannot run (a thousand nodes
need more CPU than a small machine has): the records a running job holds in
etcd are written once, as the fleet would have left them (registrations
under a lease, a progress record per node holding its workers' heartbeats,
the plan, the status, a few events and log chunks), and then, with nothing
else running:

* the controller's tick, read-only (:func:`probes.tick_cost`): the reads and
  the decoding of every record, then the policy;
* the size of each range read, against gRPC's 4 MiB receive limit;
* the recovery record the controller writes after a recovery
  (:func:`orchestrator.observe.recoveries.build_record`, from one telemetry
  entry per worker; it keeps the slowest few), written the way the controller
  writes it: etcd takes it or refuses it (``--max-request-bytes``, 1.5 MiB by
  default);
* the reads behind ``status``, ``events`` and ``logs``;
* a crash's burst of break reports: every member but one writes its
  workers' reports as one record (:func:`agents.node.break_reports.write_node_reports`,
  as their agents do), from :data:`BURST_THREADS` threads at once, and the
  tick is timed again with them in etcd.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agents.node.break_reports import write_node_reports
from agents.node.log_shipper import TAIL_BYTES, TAIL_LINES
from benchmarks._control_plane.fleet import LOG_LINE, node_labels, node_name
from orchestrator.api import EtcdError, JobPhase
from orchestrator.etcd.client import EtcdClient
from orchestrator.observe.recoveries import build_record
from orchestrator.spec.job import JobSpec
from orchestrator.state import events, keys, records
from orchestrator.state.records import (
    BreakReport,
    JobStatus,
    LogChunk,
    Member,
    NodeProgressRecord,
    NodeRecord,
    Plan,
    ProgressRecord,
    Telemetry,
)

#: Log lines stored per worker in the snapshot: the tail its agent stores when it exits
#: (as if every worker had exited once).
LINES_PER_WORKER = TAIL_LINES


def snapshot(client: EtcdClient, spec: JobSpec, nodes: int, spares: int) -> dict[str, Any]:
    """Write what a running job of ``nodes`` nodes holds in etcd; returns what was written."""
    job, workers = spec.name, spec.nproc_per_node
    now = time.time()
    lease = client.lease(3600)
    names = [node_name(i) for i in range(nodes)]
    active = names[: nodes - spares]
    members = [Member(n, i * workers, workers, node_labels(i)) for i, n in enumerate(active)]
    plan = Plan(2, members, spares=names[nodes - spares :], reason="n00000 replaces n09999")
    items: list[tuple[str, bytes]] = []
    telemetry: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        pids = [100_000 + i * 1000 + lr for lr in range(workers)]
        registration = NodeRecord(
            host=name,
            address="127.0.0.1",
            slots=workers,
            pid=100_000 + i * 1000 + 999,
            worker_pids=pids,
            started=now,
            labels=node_labels(i),
            liveness="127.0.0.1:1",
            recovery="in_process",
        )
        client.put(keys.job_node(job, name), registration.encode(), lease)
        member = plan.member(name)
        node_progress: dict[str, ProgressRecord] = {}
        for lr in range(workers):
            worker = keys.worker_id(name, lr)
            tel = Telemetry(
                generation=2 if member else 0,
                group_formed_at=now - 5 if member else None,
                restored_at=now - 5 if member else None,
                restored_step=1000 if member else None,
                first_step_at=now - 4 if member else None,
                wire_bytes=1234 * 4_000_000,
                dense_bytes=1234 * 4_000_000,
            )
            progress = ProgressRecord(
                step=1234 if member else 0,
                generation=2 if member else 0,
                rank=member.rank_base + lr if member else -1,
                world_size=plan.world_size if member else 0,
                pid=pids[lr],
                beat=now,
                step_time=now,
                recoveries=1 if member else 0,
                last_recovery_s=0.62 if member else None,
                metrics={"loss": 1.1, "samples": 32.0} if member else {},
                telemetry=tel,
            )
            node_progress[worker] = progress
            if member:
                telemetry[worker] = dataclasses.asdict(tel)
            lines = [(now, LOG_LINE.format(step=s, loss=1.1)) for s in range(LINES_PER_WORKER)]
            chunk = LogChunk(name, lr, lines).encode().encode()
            items.append((keys.worker_log_tail(job, name, lr), chunk))
        # the node's agent writes its workers' progress as one record (agents.node.progress_relay)
        record = NodeProgressRecord(now, node_progress)
        items.append((keys.node_progress(job, name), record.encode().encode()))
    client.put_many(items)
    records.write(client, keys.job_plan(job), plan)
    status = JobStatus(
        name=job,
        phase=JobPhase.RUNNING,
        step=1234,
        world_size=plan.world_size,
        generation=2,
        active_nodes=active,
        spare_nodes=plan.spares,
        failed_nodes=["n09999"],
        recoveries=1,
        updated_at=now,
    )
    records.write(client, keys.job_status(job), status)
    for name in names:  # what the controller logs as the nodes come
        events.emit(client, job, "NodeRegistered", f"{name} registered", node=name)
    recovery = build_record(
        generation=2,
        cause="node_lost",
        nodes=["n09999"],
        reason="n00000 replaces n09999",
        failure_at=now - 8,
        declared_at=now - 7,
        workers=telemetry,
        step=1234,
        observed_s=3.0,
    )
    encoded = len(recovery.encode().encode())
    try:  # as JobObserver.recovered writes it
        records.write(client, keys.job_recovery(job, 1, 2), recovery)
        refused = ""
    except EtcdError as e:
        refused = str(e)[:300]
    return {
        "recovery_record_bytes": encoded,
        "recovery_record_refused": refused,
        "plan_bytes": len(plan.encode()),
        "status_bytes": len(status.encode()),
        "log_tail_bytes_per_worker": TAIL_BYTES,
    }


def tick_repeated(client: EtcdClient, job: str, repeats: int) -> dict[str, Any]:
    """The controller's read-only tick, or the error that stops it."""
    from benchmarks._control_plane import probes

    try:
        cost = probes.tick_cost(client, job, repeats)
    except EtcdError as e:
        return {"tick_error": str(e)[:300]}
    return {
        "tick_read_ms": round(cost["read_ms"], 1),
        "tick_decide_ms": round(cost["decide_ms"], 1),
    }


#: Threads that write a burst of break reports (each a node agent's one put).
BURST_THREADS = 32


def report_burst(client: EtcdClient, job: str, nodes: int, workers: int) -> dict[str, Any]:
    """The members of generation 2 but the first report its break, one record a node."""
    report = BreakReport(step=1000, reason="n00000 is gone", planned=False, at=time.time())

    def one(index: int) -> None:
        name = node_name(index)
        reports = {keys.worker_id(name, lr): report for lr in range(workers)}
        write_node_reports(client, job, 2, name, reports)

    started = time.monotonic()
    with ThreadPoolExecutor(BURST_THREADS) as pool:
        list(pool.map(one, range(1, nodes)))
    took = time.monotonic() - started
    return {"report_burst_puts": nodes - 1, "report_burst_s": round(took, 3)}
