"""The tiny job of ``train_tiny.py``, with its model sharded (FSDP2's ``fully_shard``).

``--sharding fsdp`` shards the MLP over every rank; ``hsdp`` shards it within
each node and replicates across nodes; ``--mesh tensor=2`` (or
``replicate=2,shard=1,tensor=2``) splits its two layers over 2 neighbouring
ranks (tensor parallel) and replicates across the rest; ``--mesh pipeline=2``
cuts it into 2 stages run as a pipeline (``--schedule``, ``--microbatches``).
A lost rank's slice
comes back from its twin (``hsdp``, ``--mesh``), from a buddy's host-memory copy
(``fsdp``, unless ``--redundancy-every-steps 0``) or from the newest durable
checkpoint.  The
data order is fixed by the step, so a run with a failure ends with the same
parameters as one without.

Run it with ``ringmaster run examples/sharded.yaml``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from train_tiny import CLASSES, FEATURES, GLOBAL_BATCH, batch, dataset

from agents import runtime


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """SGD with momentum, or Adam (per-parameter state and a step count)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def parse_mesh(text: str) -> dict[str, int]:
    """``replicate=2,tensor=2`` as ``{"replicate": 2, "tensor": 2}``."""
    try:
        return {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--mesh {text!r}: write dimension=size pairs, e.g. replicate=2,tensor=2"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sharding", default="fsdp", choices=["ddp", "fsdp", "hsdp"])
    parser.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        help="instead of --sharding: dimension sizes, e.g. replicate=2,tensor=2",
    )
    parser.add_argument(
        "--redundancy-every-steps",
        type=int,
        default=None,
        help="fsdp: copy each slice to a buddy every N steps (0: off; default: the runtime's)",
    )
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", type=int, default=4, help="with mesh pipeline > 1")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--width", type=int, default=32, help="hidden units of the MLP")
    parser.add_argument("--steps", type=int, default=0, help="0: the job's max_steps")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--out", help="directory: each rank writes its rows of the parameters")
    parser.add_argument("--step-log", help="directory: each worker logs the steps it applied")
    parser.add_argument(
        "--hold-at",
        type=int,
        default=-1,
        help="with --go-file: every worker waits before this step until the file exists",
    )
    parser.add_argument("--go-file", help="see --hold-at")
    args = parser.parse_args()

    torch.manual_seed(0)
    session = runtime.init()
    x, y = (t.to(session.device) for t in dataset())
    net = nn.Sequential(nn.Linear(FEATURES, args.width), nn.ReLU(), nn.Linear(args.width, CLASSES))
    extra = {}
    if args.redundancy_every_steps is not None:
        extra["redundancy_every_steps"] = args.redundancy_every_steps
    pipelined = args.mesh is not None and args.mesh.get("pipeline", 1) > 1
    if pipelined:
        # the schedule averages the micro-batches' losses: each is scaled to stand for
        # its share of the global batch's mean, as the unpipelined loss below is
        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            shares = model.data_world_size * args.microbatches
            return F.cross_entropy(out, target, reduction="sum") * shares / GLOBAL_BATCH

        pipe = runtime.Pipeline(loss_fn, microbatches=args.microbatches, schedule=args.schedule)
        model = session.wrap(net, mesh=args.mesh, pipeline=pipe, **extra)
    elif args.mesh is not None:
        model = session.wrap(net, mesh=args.mesh, **extra)
    else:
        model = session.wrap(net, sharding=args.sharding, **extra)
    opt = make_optimizer(args.optimizer, model.parameters())
    session.track(model=model, optimizer=opt)
    loss = torch.tensor(0.0)
    total = args.steps or session.spec.max_steps
    whole: dict[str, torch.Tensor] = {}  # a mesh's parameters, gathered after the last step
    for step in session.steps(total or None):
        while step == args.hold_at and args.go_file and not os.path.exists(args.go_file):
            time.sleep(0.05)  # the same step on every rank: no collective waits on it
        with session.guard():
            # tensor-parallel ranks of one replica read the same share of the batch
            rank, world = (
                (model.data_rank, model.data_world_size)
                if args.mesh is not None
                else (session.rank, session.world_size)
            )
            xb, yb = batch(step, rank, world, x, y)
            opt.zero_grad()
            if pipelined:  # forward and backward through the stages
                loss = model.step(xb, yb)
            else:  # mean over the global batch: gradients are averaged over the shares
                loss = F.cross_entropy(model(xb), yb, reduction="sum") * world / GLOBAL_BATCH
                loss.backward()
            opt.step()
            if args.mesh is not None and args.out and step + 1 == total:
                whole = model.full_parameters()  # a collective: while the group is up
            if args.step_time:
                time.sleep(args.step_time)
        if session.step_failed:
            continue
        session.report(loss=loss.item(), samples=len(yb))
        if args.step_log:
            with open(os.path.join(args.step_log, f"{session.worker}-{os.getpid()}.log"), "a") as f:
                f.write(f"{step} {session.generation} {session.rank} {time.time()}\n")
    if session.finished and args.out:
        if args.mesh is not None:  # whole tensors, gathered on every rank
            rows = {n: (0, p.shape[0], p) for n, p in whole.items()}
        elif args.sharding != "ddp":
            rows = model.local_parameters()
        else:
            rows = {n: (0, p.shape[0], p.detach()) for n, p in model.module.named_parameters()}
        torch.save(rows, os.path.join(args.out, f"rank-{session.rank}.pt"))
    session.close()


if __name__ == "__main__":
    main()
