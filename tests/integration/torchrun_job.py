"""A tiny DDP job for the torchrun tests: gloo, CPU, a linear model, a few steps.

Run by stock ``torchrun``.  Every worker appends JSON lines to
``$RM_TEST_OUT/<RM_NODE_TAG>.log`` so the test can see which node holds
which rank, when training is under way and how the run ended:

* ``{"event": "step", "step": s, "world": w, "group_rank": g, "t": time, ...}`` per step;
* ``{"event": "done", "world": w, "restart": r, ...}`` when the loop finishes.

Arguments: ``--steps N`` (default 40) and ``--step-seconds S`` (default 0.1).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _log(record: dict[str, object]) -> None:
    path = os.path.join(os.environ["RM_TEST_OUT"], os.environ["RM_NODE_TAG"] + ".log")
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({**record, "t": time.time()}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    world = dist.get_world_size()
    common = {
        "rank": dist.get_rank(),
        "world": world,
        "group_rank": int(os.environ["GROUP_RANK"]),
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "pid": os.getpid(),
    }
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        _log({"event": "step", "step": step, **common})
        time.sleep(args.step_seconds)
    dist.barrier()
    _log({"event": "done", **common})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
