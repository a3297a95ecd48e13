"""The peers benchmark's job on torchft: one replica group of one process.

Wired as torchft's own DDP example (train_ddp.py) does it: a ``Manager`` with
``ProcessGroupGloo`` across replica groups, ``min_replica_size=1``, torchft's
``DistributedDataParallel`` and ``Optimizer`` wrappers (the quorum starts in
``zero_grad``, the commit is voted in ``step``), and recovery of a joining
replica from a live peer (the Manager's default HTTP checkpoint transport).
The replica group's own TCPStore is hosted here (the group has one process).

Data: step ``s`` (the Manager's committed step count) is global batch ``s``,
split over the replicas that participate in the step, by their rank in the
quorum; each rank's loss is scaled so that torchft's average over the
participants is the mean over the global batch, at any number of replicas.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from common import StepLog, batch, dataset, loss_of, make_model, make_opt
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replica-group", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--step-log")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    net = make_model()
    opt = make_opt(net.parameters())

    def load_state_dict(state: dict[str, object]) -> None:
        net.load_state_dict(state["model"])  # type: ignore[arg-type]
        opt.load_state_dict(state["optim"])  # type: ignore[arg-type]

    def state_dict() -> dict[str, object]:
        return {"model": net.state_dict(), "optim": opt.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"peers_{args.replica_group}",
        timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        hostname="127.0.0.1",
    )
    model = DistributedDataParallel(manager, net)
    optimizer = Optimizer(manager, opt)
    x, y = dataset()
    log = StepLog(args.step_log)
    while manager.current_step() < args.steps:
        t0 = time.time()
        optimizer.zero_grad()  # starts the quorum
        rank = manager.participating_rank()  # waits for it
        world = manager.num_participants()
        step = manager.current_step()
        # a healing replica contributes zeros this step: any batch will do
        xb, yb = batch(step, rank or 0, max(world, 1), x, y)
        loss_of(model, xb, yb, max(world, 1)).backward()
        if args.step_time:
            time.sleep(args.step_time)
        optimizer.step()  # applies the update only when every participant commits
        if manager.current_step() > step:  # committed (a healed replica jumps ahead)
            log.done(manager.current_step() - 1, t0, world)
    if args.out:
        torch.save(net.state_dict(), f"{args.out}.{os.getpid()}")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
