"""A new plan reaching every worker of a node: by the agent's feed, or by each worker's watch.

A real etcd (embedded), ``--nodes`` simulated nodes of ``--workers`` workers,
each worker a real :class:`agents.runtime.plan_watch.PlanWatcher`, and a plan of
``--plan-members`` members (1,000 by default: 110 KB, the plan of a
1,000-node job).  The same plans are published, side by side in one run, to:

* ``watch``: every worker watching the plan and control keys in etcd itself
  (what a worker did before the feed), beside its agent's own watch;
* ``feed``: the agent watching them (:class:`agents.node.watches.NodeWatches`)
  and passing them to its workers through its :class:`agents.channels.plan_feed.PlanFeed`.

For each: bytes etcd sent to its clients per plan (its
``etcd_network_client_grpc_sent_bytes_total``), etcd watchers, and seconds
from the put to every worker holding the plan.  All workers run as threads
of this one process, so each plan's decode (every worker decodes it, in
either way) is serial here where real workers decode in parallel: the times
measure this process as much as the delivery; the bytes do not.

The last line of stdout is one JSON object with the headline figures.
``--smoke``: 2 nodes of 2 workers, a plan of 10 members, 1 plan per mode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.channels.plan_feed import PlanFeed
from agents.node.watches import NodeWatches
from agents.runtime.plan_watch import PlanWatcher
from benchmarks._control_plane.etcd_metrics import scrape
from benchmarks._smoke import parse, result_line
from orchestrator.etcd.client import connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.state import keys, records
from orchestrator.state.records import Member, Plan

#: Longest wait for every worker to hold a plan before the run fails loudly.
DELIVERY_TIMEOUT_S = 60.0


def big_plan(generation: int, members: int) -> Plan:
    labels = {"zone": "z0", "rack": "rack-000", "host": "host-0000"}
    return Plan(
        generation,
        [Member(f"node-{i:04d}", i * 8, 8, dict(labels)) for i in range(members)],
        spares=[f"spare-{i}" for i in range(4)],
        reason="node-0001 failed: peer gone",
    )


def wait_all(watchers: list[PlanWatcher], generation: int) -> None:
    deadline = time.monotonic() + DELIVERY_TIMEOUT_S
    for w in watchers:
        if w.wait_newer(generation - 1, max(0.0, deadline - time.monotonic())) is None:
            raise SystemExit(f"a worker did not get plan {generation} in {DELIVERY_TIMEOUT_S}s")


def run_mode(mode: str, etcd: EmbeddedEtcd, args: argparse.Namespace) -> dict[str, float]:
    job = f"feed-bench-{mode}-{uuid.uuid4().hex[:6]}"
    client = connect(EtcdOptions((etcd.endpoint,)))
    feeds = [PlanFeed() if mode == "feed" else None for _ in range(args.nodes)]
    agents = [NodeWatches(client, job, f"node-{n}", feeds[n]) for n in range(args.nodes)]
    for a in agents:
        a.watch_plan()
    workers = [
        PlanWatcher(client, job, feed.address if feed is not None else None)
        for feed in feeds
        for _ in range(args.workers)
    ]
    time.sleep(1.0)  # every watch and feed connection established
    before = scrape([etcd.url])
    times = []
    for generation in range(1, args.plans + 1):
        value = big_plan(generation, args.plan_members)
        start = time.monotonic()
        records.write(client, keys.job_plan(job), value)
        wait_all(workers, generation)
        times.append(time.monotonic() - start)
    time.sleep(0.5)  # the last sends counted
    after = scrape([etcd.url])
    sent = after.summed("etcd_network_client_grpc_sent_bytes_total") - before.summed(
        "etcd_network_client_grpc_sent_bytes_total"
    )
    watchers = after.summed("etcd_debugging_mvcc_watcher_total")
    for w in workers:
        w.stop()
    for a in agents:
        a.request_stop()
    for f in feeds:
        if f is not None:
            f.close()
    client.close()
    return {
        "etcd_sent_mb_per_plan": sent / args.plans / 1e6,
        "etcd_watchers": watchers,
        "put_to_every_worker_s_median": statistics.median(times),
        "put_to_every_worker_s_max": max(times),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--workers", type=int, default=8, help="workers per node")
    p.add_argument("--plan-members", type=int, default=1000, help="nodes the plan lists")
    p.add_argument("--plans", type=int, default=5, help="plans published in each mode")
    args = parse(p, {"nodes": 2, "workers": 2, "plan_members": 10, "plans": 1})
    size = len(big_plan(1, args.plan_members).encode())
    print(f"{args.nodes} nodes x {args.workers} workers, a plan of {size / 1e3:.0f} KB")
    with EmbeddedEtcd() as etcd:
        results = {mode: run_mode(mode, etcd, args) for mode in ("watch", "feed")}
    for mode, r in results.items():
        print(
            f"{mode:>5}: {r['etcd_sent_mb_per_plan']:.2f} MB out of etcd per plan, "
            f"{r['etcd_watchers']:.0f} watchers, put -> every worker "
            f"{r['put_to_every_worker_s_median']:.3f} s median, "
            f"{r['put_to_every_worker_s_max']:.3f} s max"
        )
    watch, feed = results["watch"], results["feed"]
    print(
        result_line(
            {
                "nodes": args.nodes,
                "workers_per_node": args.workers,
                "plan_kb": round(size / 1e3, 1),
                "etcd_mb_per_plan_watch": round(watch["etcd_sent_mb_per_plan"], 3),
                "etcd_mb_per_plan_feed": round(feed["etcd_sent_mb_per_plan"], 3),
                "etcd_bytes_ratio_watch_over_feed": round(
                    watch["etcd_sent_mb_per_plan"] / feed["etcd_sent_mb_per_plan"], 2
                ),
                "etcd_watchers_watch": watch["etcd_watchers"],
                "etcd_watchers_feed": feed["etcd_watchers"],
                "every_worker_s_median_watch": round(watch["put_to_every_worker_s_median"], 4),
                "every_worker_s_median_feed": round(feed["put_to_every_worker_s_median"], 4),
                "every_worker_s_ratio_watch_over_feed": round(
                    watch["put_to_every_worker_s_median"] / feed["put_to_every_worker_s_median"],
                    2,
                ),
            },
            args.smoke,
        )
    )


if __name__ == "__main__":
    main()
