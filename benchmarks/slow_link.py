"""A slow link seen through the step timings: which rank does it point at?

Three gloo ranks train a small DDP model (3 MiB of gradients, ``--compute``
CPU seconds a step) through the runtime's own comm hook and
:class:`~agents.runtime.step_timing.StepTiming`.  One rank (``--slow-rank``)
runs in a network namespace (``tests/faults/netns.py``) whose veth is limited
with ``tc … tbf`` at ``--rate`` on both ends; the others run on the host.
Per rank it reports what the controller sees (compute and wait per step, and
the compute over the median of the other ranks', as the judgement computes
a slowdown) and, beside it, what the heartbeats do not carry: how much
later than the first rank it posted its last gradient bucket and saw the
reduction complete (wall clock, exact on one machine).

``--rate none`` runs the same job without a limit.  Needs root (network
namespaces).  The findings are in docs/stragglers.md ("Not yet").  The last
line is one JSON object.  ``--smoke``: 2 steps past the ``SKIP`` left out, 1 ms of
compute each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agents.runtime.step_timing import StepTiming  # noqa: E402
from benchmarks._smoke import parse, result_line  # noqa: E402
from benchmarks._worker_end import exit_now, keep  # noqa: E402

PORT = 29533
WORLD = 3
#: steps left out at the start (DDP's bucket rebuild, the sockets' warm-up)
SKIP = 10


class WallTiming(StepTiming):
    """:class:`StepTiming` that also keeps the wall-clock time of the last post and
    completion, to compare ranks with each other."""

    __slots__ = ("done_wall", "post_wall")

    def __init__(self) -> None:
        super().__init__()
        self.post_wall = self.done_wall = 0.0

    def posted(self) -> None:
        super().posted()
        self.post_wall = time.time()

    def completed(self) -> None:
        super().completed()
        self.done_wall = time.time()


def worker(rank: int, addr: str, out: str, steps: int, compute: float) -> NoReturn:
    """One rank: ``steps`` DDP steps; a JSON row per step to ``out``; then the process
    ends (:mod:`benchmarks._worker_end`)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from agents.runtime.failures import CollectiveFailures

    # the store is served on the host, by a rank that is not the slowed one
    serves = rank == int(os.environ["SLOW_LINK_STORE_RANK"])
    store = dist.TCPStore(addr, PORT, WORLD, serves, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    ddp = keep(DDP(nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 512))))
    timing = WallTiming()
    DDP.register_comm_hook(ddp, None, CollectiveFailures(timing).allreduce_hook())
    x = torch.randn(16, 1024)
    rows = []
    for _ in range(steps):
        compute0, wait0 = timing.compute_s, timing.wait_s
        end = time.process_time() + compute
        while time.process_time() < end:
            pass
        ddp(x).sum().backward()
        post, done = timing.post_wall, timing.done_wall
        timing.step_done()
        rows.append(
            {
                "post": post,
                "done": done,
                "compute": timing.compute_s - compute0,
                "wait": timing.wait_s - wait0,
            }
        )
    Path(out).write_text(json.dumps(rows))
    dist.barrier()
    exit_now()


def measure(rate: str, slow: int, steps: int, compute: float) -> dict[str, Any]:
    """Run the three ranks once; per rank, the figures of the module docstring."""
    from tests.faults.netns import IsolatedNode

    py = sys.executable
    env = dict(os.environ, PYTHONPATH=str(REPO), SLOW_LINK_STORE_RANK=str(1 if slow != 1 else 0))
    with (
        tempfile.TemporaryDirectory(prefix="ringmaster-slow-link-") as d,
        IsolatedNode("slowlink") as node,
    ):
        if rate != "none":
            node.limit(rate)
        procs = []
        for r in range(WORLD):
            argv = [
                py,
                __file__,
                "--worker",
                str(r),
                "--addr",
                node.host_ip,
                "--out",
                f"{d}/{r}.json",
                "--steps",
                str(steps),
                "--compute",
                str(compute),
            ]
            ifname = node.node_if if r == slow else node.host_if
            procs.append(
                subprocess.Popen(
                    node.command(argv) if r == slow else argv,
                    env=dict(env, GLOO_SOCKET_IFNAME=ifname),
                )
            )
        try:
            for r, p in enumerate(procs):
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"rank {r} exited with {p.returncode}")
        finally:  # a rank that failed or hung takes the others with it
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        rows = [json.loads(Path(f"{d}/{r}.json").read_text())[SKIP:] for r in range(WORLD)]
    n = min(len(r) for r in rows)
    compute_ms = [1e3 * statistics.mean(x["compute"] for x in rows[r]) for r in range(WORLD)]
    out: dict[str, Any] = {"rate": rate, "slow_rank": slow, "steps": n, "ranks": []}
    for r in range(WORLD):
        peers = statistics.median(c for q, c in enumerate(compute_ms) if q != r)

        def late(field: str, rank: int = r) -> float:
            first = (min(rows[q][s][field] for q in range(WORLD)) for s in range(n))
            return round(
                1e3 * statistics.median(rows[rank][s][field] - f for s, f in enumerate(first)), 1
            )

        out["ranks"].append(
            {
                "rank": r,
                "compute_ms": round(compute_ms[r], 1),
                "wait_ms": round(1e3 * statistics.mean(x["wait"] for x in rows[r]), 1),
                "slowdown": round(compute_ms[r] / peers, 2),
                "posted_late_ms": late("post"),
                "done_late_ms": late("done"),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tbf rate each way, or none")
    parser.add_argument("--slow-rank", type=int, default=0, choices=range(WORLD))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--compute", type=float, default=0.01, help="CPU seconds per step")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parse(parser, {"steps": SKIP + 2, "compute": 0.001})
    if args.worker is not None:
        worker(args.worker, args.addr, args.out, args.steps, args.compute)
        return
    from tests.faults.netns import unavailable_reason

    reason = unavailable_reason()
    if reason is None and shutil.which("tc") is None:
        reason = "the `tc` command (iproute2) is not installed"
    if reason is not None:  # `make bench` goes on with the other benchmarks
        print(f"skipped: {reason}")
        print(result_line({"skipped": True, "reason": reason}, args.smoke))
        return
    figures = measure(args.rate, args.slow_rank, args.steps, args.compute)
    print(f"tbf {args.rate} on rank {args.slow_rank}'s link, {figures['steps']} steps")
    for r in figures["ranks"]:
        print("  ".join(f"{k} {v}" for k, v in r.items()))
    print(result_line(figures, args.smoke))


if __name__ == "__main__":
    main()
