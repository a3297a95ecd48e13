"""A DDP script that ends in the bad order on purpose (an unmodified torchrun script).

Run by the restart tier in ``tests/integration/test_restart_ends.py``.  Both
ranks train a few steps; then the rank named by ``--first`` returns at once
(no barrier: rank 0, the store's host, may be gone before the other rank
ends), while the other rank starts one more all-reduce from backward (as DDP
does), leaves it in flight, destroys the process group and returns.  The
group's last reference then goes with ``main()``'s frame while a gloo thread
still holds that all-reduce: in torch 2.13 that deadlocked the worker's
teardown for good unless the group outlives the script (see
:mod:`agents.node.warm_standby`).
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _all_reduce_in_flight(grad: torch.Tensor) -> None:
    dist.all_reduce(grad.clone(), async_op=True)  # its work is dropped here, unfinished


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--first", type=int, default=0, help="the rank that ends first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    for _ in range(3):
        model(torch.randn(8, 4)).sum().backward()
    if dist.get_rank() == args.first:
        return
    w = torch.ones(4, requires_grad=True)
    w.register_hook(_all_reduce_in_flight)
    (w * 2).sum().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
