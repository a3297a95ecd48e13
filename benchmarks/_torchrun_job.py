"""The benchmark's job written the usual torchrun way (checkpoint every step).

Same model, data and batch as examples/train_tiny.py.  Rank 0 saves a
checkpoint after every step (torchrun's best case: on a restart at most one
step is lost); on start every worker loads the latest one.  Each completed
step is appended to ``<log>/<pid>.log`` as ``time step``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from train_tiny import CLASSES, FEATURES, GLOBAL_BATCH, batch, dataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steplog-dir", required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = dataset()
    net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    model = DDP(net)
    log = open(os.path.join(args.steplog_dir, f"{os.getpid()}.log"), "a")  # noqa: SIM115
    for step in range(start, args.steps):
        xb, yb = batch(step, rank, world, x, y)
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb, reduction="sum") * world / GLOBAL_BATCH
        loss.backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        if rank == 0:
            tmp = args.ckpt + ".tmp"
            torch.save(
                {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, tmp
            )
            os.replace(tmp, args.ckpt)
        log.write(f"{step} 0 {rank} {time.time()}\n")
        log.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
