"""The peers benchmark's job on ringmaster's runtime (in-process hot-swap)."""

from __future__ import annotations

import argparse
import time

import torch
from common import StepLog, batch, dataset, loss_of, make_model, make_opt

from agents import runtime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=0, help="0: the job's max_steps")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--step-log")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    session = runtime.init()
    x, y = dataset()
    model = session.wrap(make_model())
    opt = make_opt(model.parameters())
    session.track(model=model, optimizer=opt)
    log = StepLog(args.step_log)
    for step in session.steps(args.steps or None):
        t0 = time.time()
        with session.guard():
            xb, yb = batch(step, session.rank, session.world_size, x, y)
            opt.zero_grad()
            loss_of(model, xb, yb, session.world_size).backward()
            opt.step()
            if args.step_time:
                time.sleep(args.step_time)
        if session.step_failed:
            continue
        log.done(step, t0, session.world_size)
    if session.finished and session.rank == 0 and args.out:
        torch.save(model.module.state_dict(), args.out)
    session.close()


if __name__ == "__main__":
    main()
