"""One rank of the stuck-collective tests (tests/cuda/test_nccl_groups.py on
two GPUs with NCCL, tests/integration/test_stuck_collective.py on gloo).

Forms a generation through the runtime's own ``form_group`` and guards it
with a :class:`CollectiveGuard` whose "latest generation" is 2 once the file
``--moved`` exists (the test's stand-in for the controller's new plan).  Rank
1 signals readiness and is then SIGSTOPped by the test; rank 0 keeps
all-reducing and writes how its stuck collective ended to ``--out``.

Arguments: RANK ETCD_ENDPOINT JOB --moved FILE --out FILE [--backend nccl|gloo]
[--op-timeout SECONDS] (the guard's ceiling, what applies before any step is learnt)
[--between-sites] (the ranks are two sites of a delayed sync, each its own leader:
rank 0 waits in an outer sync's round for rank 1's offer, as long as the guard
learnt from two outer syncs of 0.05 s: its floor of 1 s, not the ceiling)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from agents.runtime.collective_guard import CollectiveGuard, OpTimeout
from agents.runtime.process_group import choose_device, form_group, teardown_group
from agents.sync.round_exchange import RoundExchange, RoundPlace
from agents.sync.round_media import RoundsInStore, generation_store
from agents.sync.rounds import Offer
from orchestrator.etcd.client import connect
from orchestrator.etcd.options import EtcdOptions, parse_endpoints


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("rank", type=int)
    p.add_argument("endpoint")
    p.add_argument("job")
    p.add_argument("--moved", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--backend", default="nccl")
    p.add_argument("--op-timeout", type=float, default=120.0)
    p.add_argument("--between-sites", action="store_true")
    a = p.parse_args()
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"  # a failed work raises in wait()
    client = connect(EtcdOptions(endpoints=parse_endpoints(a.endpoint)))
    backend, device = choose_device(a.backend, a.rank if a.backend == "nccl" else 0)
    groups = form_group(client, a.job, 1, a.rank, 2, "127.0.0.1", backend=backend, device=device)
    floor = 1.0 if a.between_sites else a.op_timeout
    guard = CollectiveGuard(
        OpTimeout(floor=floor, multiple=10, ceiling=a.op_timeout),
        latest_generation=lambda: 2 if a.moved.exists() else 1,
    )
    guard.attach(groups, 1)
    if a.between_sites:
        guard.outer_synced(0.05)  # a generation's first sync is not learnt from
        guard.outer_synced(0.05)
    t = torch.ones(1 << 16, device=device)
    for _ in range(5):
        dist.all_reduce(t, async_op=True).wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if a.rank == 1:
        (a.out.parent / "rank1.ready").write_text(str(os.getpid()))
        time.sleep(600)  # SIGSTOPped here by the test
        return
    started = time.monotonic()
    try:
        if a.between_sites:  # a round of fragment 0 started at step 10 that rank 1 never offers to
            place = RoundPlace(fragment=0, at=10, site=0, sites=2)
            round_ = RoundExchange(
                RoundsInStore(generation_store()),
                place,
                [t],
                lambda: [torch.empty_like(t)],
                Offer(1.0, (), 0),
                2,
                timedelta(0),
            )
            round_.wait(lambda: False, guard.timeout.between_sites())
        while True:
            dist.all_reduce(t, async_op=True).wait()
    except Exception as e:  # the stuck collective's error is the result
        a.out.write_text(
            json.dumps(
                {
                    "ended_by": guard.ended_by(e),
                    "seconds": time.monotonic() - started,
                    "error": str(e)[:300],
                }
            )
        )
    finally:
        guard.close()
        teardown_group()


if __name__ == "__main__":
    main()
