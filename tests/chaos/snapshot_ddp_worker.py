"""An ordinary CPU DDP script that keeps its own snapshot (nothing in it knows ringmaster).

The shape of the DDP tutorials' torchrun scripts: ``init_process_group`` from
torchrun's environment, a ``DistributedSampler``, rank 0 saves a snapshot
(model and epochs run) after every epoch and every rank loads it at start,
and at the end ``destroy_process_group`` without a barrier, so the ranks end
in whatever order they reach it.  ``--snapshot`` says where the snapshot is.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--snapshot", default="snapshot.pt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_process_group(backend="gloo")
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(512, 20, generator=g), torch.rand(512, 1, generator=g))
    loader = DataLoader(data, batch_size=32, shuffle=False, sampler=DistributedSampler(data))
    model = torch.nn.Linear(20, 1)
    epochs_run = 0
    snapshot = Path(args.snapshot)
    if snapshot.exists():
        state = torch.load(snapshot, weights_only=True)
        model.load_state_dict(state["model"])
        epochs_run = int(state["epochs_run"])
        print(f"resuming from the snapshot at epoch {epochs_run}", flush=True)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for epoch in range(epochs_run, args.epochs):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            optimizer.step()
        if rank == 0:
            torch.save({"model": model.state_dict(), "epochs_run": epoch + 1}, snapshot)
            print(f"epoch {epoch} done; snapshot saved", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    main()
