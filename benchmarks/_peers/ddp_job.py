"""The peers benchmark's job as a plain torchrun script (no ringmaster, no torchft).

Three uses: plain DDP with no fault tolerance (``--checkpoint-every 0``), stock
torchrun with elastic restarts, and ringmaster's restart tier (tier 0), which
runs it unchanged.  Rank 0 saves model, optimizer and steps done every
``--checkpoint-every`` steps (atomically, the newest two kept) into
``$RINGMASTER_CHECKPOINT_DIR`` or ``--checkpoint-dir``; every rank resumes from
the newest one rank 0 finds.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from common import StepLog, batch, dataset, loss_of, make_model, make_opt
from torch.nn.parallel import DistributedDataParallel


def _save(directory: Path, state: dict[str, object], step: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{step:08d}.pt"
    tmp = final.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, final)
    for old in sorted(directory.glob("ckpt-*.pt"))[:-2]:
        old.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--checkpoint-every", type=int, default=0, help="0: never")
    p.add_argument("--checkpoint-dir", default="")
    p.add_argument("--step-log")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_dir = Path(os.environ.get("RINGMASTER_CHECKPOINT_DIR") or args.checkpoint_dir or ".")
    net = make_model()
    opt = make_opt(net.parameters())
    x, y = dataset()
    pick = [""]
    if rank == 0 and args.checkpoint_every:
        found = sorted(ckpt_dir.glob("ckpt-*.pt"))
        pick = [str(found[-1]) if found else ""]
    dist.broadcast_object_list(pick, src=0)
    start = 0
    if pick[0]:
        state = torch.load(pick[0], weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    model = DistributedDataParallel(net)
    log = StepLog(args.step_log)
    for step in range(start, args.steps):
        t0 = time.time()
        xb, yb = batch(step, rank, world, x, y)
        opt.zero_grad()
        loss_of(model, xb, yb, world).backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        if rank == 0 and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}
            _save(ckpt_dir, state, step + 1)
        log.done(step, t0, world)
    if rank == 0 and args.out:
        torch.save(net.state_dict(), args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
