"""An ordinary torchrun script: DistributedSampler, DataLoader, DDP, its own checkpoints.

Nothing in it knows ringmaster.  It runs under stock torchrun::

    torchrun --standalone --nproc-per-node=2 examples/train_torchrun.py

and, unchanged, under ringmaster's restart tier (``ringmaster run
examples/torchrun.yaml``), which gives it torchrun's environment and, after a
failure, starts every worker again.  Rank 0 saves a checkpoint (model,
optimizer, steps done) every ``--checkpoint-every`` steps into
``$RINGMASTER_CHECKPOINT_DIR`` (``--checkpoint-dir`` when that is unset, as
under plain torchrun); every rank resumes from the newest one rank 0 finds,
at the same batch of the same epoch, so a run with a failure ends with the
same parameters as a run without one (at the same world size).

``--width``, ``--hidden-layers`` and ``--optimizer adam`` make its state as
large as wanted (``benchmarks/restart_at_size.py`` runs it at 0.1 to 2 GB of
parameters and Adam state, with a small batch so a step stays cheap); with
``--step-log`` each start also appends one JSON line of when it got where
(``rank-<rank>.starts``: entered ``main``, process group, checkpoint read,
state loaded, DDP built), so the part of a restart spent in the script's own
``torch.load`` can be told apart.
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
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, CLASSES, SAMPLES = 16, 4, 1024


def dataset(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=g)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    x = centers[labels] + 2.5 * torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, labels)


def newest_checkpoint(directory: Path) -> Path | None:
    found = sorted(directory.glob("ckpt-*.pt"))
    return found[-1] if found else None


def save_checkpoint(directory: Path, state: dict[str, object], step: int, keep: int = 2) -> None:
    """Write atomically (a temporary file renamed), keep the newest ``keep``."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{step:08d}.pt"
    tmp = final.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, final)
    for old in sorted(directory.glob("ckpt-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--width", type=int, default=32, help="hidden units")
    parser.add_argument("--hidden-layers", type=int, default=0, help="width x width layers")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", default="checkpoints/train_torchrun")
    parser.add_argument("--out", help="rank 0 writes the final parameters here")
    parser.add_argument(
        "--step-log", help="directory: each rank appends 'step time restart pid' lines"
    )
    args = parser.parse_args()
    times = {"main": time.time()}

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_dir = Path(os.environ.get("RINGMASTER_CHECKPOINT_DIR") or args.checkpoint_dir)
    times["group"] = time.time()

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(FEATURES, args.width), nn.ReLU()]
    for _ in range(args.hidden_layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, CLASSES))
    if args.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    per_epoch = len(loader)

    # rank 0 picks the checkpoint, so every rank resumes from the same one
    pick = [str(newest_checkpoint(ckpt_dir) or "") if rank == 0 else ""]
    dist.broadcast_object_list(pick, src=0)
    done = 0
    times["built"] = times["read"] = time.time()
    if pick[0]:
        state = torch.load(pick[0], weights_only=True)
        times["read"] = time.time()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        done = int(state["step"])
        del state  # the optimizer keeps its moments; the loaded parameters go
        if rank == 0:
            print(f"resumed from {pick[0]} at step {done}", flush=True)
    times["loaded"] = time.time()
    ddp = DistributedDataParallel(model)
    times["ddp"] = time.time()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log = open(Path(args.step_log) / f"rank-{rank}.log", "a") if args.step_log else None  # noqa: SIM115
    if args.step_log:
        with open(Path(args.step_log) / f"rank-{rank}.starts", "a") as starts:
            starts.write(json.dumps({"pid": os.getpid(), "from": pick[0], **times}) + "\n")

    step = done
    for epoch in range(done // per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * per_epoch + i < done:
                continue  # already trained before the restart
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if log is not None:
                log.write(f"{step} {time.time():.6f} {restart} {os.getpid()}\n")
                log.flush()
            if rank == 0 and step % args.checkpoint_every == 0:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
                save_checkpoint(ckpt_dir, state, step)
            if rank == 0 and step % 20 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if args.step_time:
                time.sleep(args.step_time)
    if rank == 0 and args.out:
        torch.save(model.state_dict(), args.out)
        print(f"finished at step {step}; parameters in {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
