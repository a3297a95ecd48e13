"""A tiny supervised job: a small MLP on a fixed synthetic classification set.

The global data order is fixed by the seed and each step consumes one global
batch (``GLOBAL_BATCH`` samples) split across ranks, so the result does not
depend on which node died when: a run with a failure ends with the same
parameters as a run without one.

Run it with ``ringmaster run examples/demo.yaml``.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch
import torch.nn.functional as F
from torch import nn

from agents import runtime

GLOBAL_BATCH = 64
FEATURES, CLASSES, SAMPLES = 16, 4, 4096


def dataset(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=g)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    x = centers[labels] + 2.5 * torch.randn(SAMPLES, FEATURES, generator=g)
    return x, labels


def make_model() -> nn.Sequential:
    """The MLP this example trains (its parameters' names are those of ``final.pt``
    without DDP's ``module.``)."""
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def batch(step: int, rank: int, world: int, x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    """Rank ``rank``'s share of global batch ``step`` (global sample offset step*GLOBAL_BATCH)."""
    start = (step * GLOBAL_BATCH) % SAMPLES
    idx = torch.arange(start, start + GLOBAL_BATCH) % SAMPLES
    share = idx.tensor_split(world)[rank]
    return x[share], y[share]


def train_step(
    session: runtime.Session,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """Global batch ``step``'s share of this rank, one SGD step on it: its loss (the mean
    over the global batch: the sum of per-rank sums / ``GLOBAL_BATCH``) and its samples."""
    xb, yb = batch(step, session.rank, session.world_size, x, y)
    opt.zero_grad()
    loss = F.cross_entropy(model(xb), yb, reduction="sum") * session.world_size / GLOBAL_BATCH
    loss.backward()
    opt.step()
    return loss, len(yb)


def node_number() -> int:
    """The number this worker's node name ends with (node-2: 2), else 0."""
    found = re.search(r"(\d+)$", os.environ.get("RINGMASTER_NODE", ""))
    return int(found.group(1)) if found else 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=0, help="0: the job's max_steps")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--out", help="rank 0 writes the final parameters here")
    parser.add_argument(
        "--step-log",
        help="directory: each worker logs the steps it applied (step, generation, rank, time, "
        "the durable checkpoint its state was last resumed from or '-')",
    )
    parser.add_argument(
        "--hold-at",
        type=int,
        default=-1,
        help="with --go-file: every worker waits before this step until the file exists "
        "(a test holds the job at one step this way)",
    )
    parser.add_argument("--go-file", help="see --hold-at")
    parser.add_argument(
        "--seed-by-node",
        action="store_true",
        help="seed the initial weights by the number the node's name ends with, as a script "
        "that does not seed alike everywhere starts its ranks apart (the job starts every "
        "replica from rank 0's weights all the same)",
    )
    args = parser.parse_args()

    torch.manual_seed(node_number() if args.seed_by_node else 0)
    session = runtime.init()
    x, y = (t.to(session.device) for t in dataset())  # the worker's GPU, where it has one
    model = session.wrap(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    session.track(model=model, optimizer=opt)
    loss, samples = torch.tensor(0.0), 0
    log_every = int(os.environ.get("RINGMASTER_LOG_EVERY", "20"))
    for step in session.steps(args.steps or None):
        while step == args.hold_at and args.go_file and not os.path.exists(args.go_file):
            time.sleep(0.05)  # the same step on every rank: no collective waits on it
        with session.guard():
            loss, samples = train_step(session, model, opt, step, x, y)
            if args.step_time:
                time.sleep(args.step_time)
        if session.step_failed:
            continue  # the step runs again in the next generation
        session.report(loss=loss.item(), samples=samples)
        if args.step_log:
            with open(os.path.join(args.step_log, f"{session.worker}-{os.getpid()}.log"), "a") as f:
                resumed = session.restored_from or "-"  # the durable checkpoint its state came from
                f.write(f"{step} {session.generation} {session.rank} {time.time()} {resumed}\n")
        if session.rank == 0 and step % log_every == 0:
            print(f"step {step} loss {loss.item():.4f} world {session.world_size}", flush=True)
    if session.finished and session.rank == 0:
        with torch.no_grad():
            acc = (model.module(x).argmax(1) == y).float().mean().item()
        print(f"finished at step {session.step}: accuracy {acc:.3f}", flush=True)
        if args.out:
            torch.save(model.state_dict(), args.out)
    session.close()


if __name__ == "__main__":
    main()
