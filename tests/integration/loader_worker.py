"""A training script for the elastic loader's job tests (run by ``ringmaster agent``).

Reads sample ``i`` = ``i`` through :class:`agents.runtime.data.ElasticLoader` with two
worker processes, trains a one-weight model on it, and tracks a counter of
applied steps besides model and optimizer.  Each worker appends to its own
file under ``--log``: ``start <step> <counter> <world size>`` when its loop
starts, and ``step <step> <rank> <world size> <indices>`` per applied step.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch.utils.data import Dataset

from agents import runtime
from agents.runtime.data import ElasticLoader


class Indexed(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--n", type=int, required=True)
    args = parser.parse_args()

    session = runtime.init()
    model = session.wrap(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    progress = Counter()
    session.track(model=model, optimizer=opt, progress=progress)
    loader = ElasticLoader(Indexed(args.n), session, args.batch, seed=7, num_workers=2)
    path = os.path.join(args.log, f"{session.worker}-{os.getpid()}.log")
    started = False
    for step in session.steps():
        if not started:
            with open(path, "a") as f:
                f.write(f"start {step} {progress.value} {session.world_size}\n")
            started = True
        with session.guard():
            idx = loader.batch(step)
            x = idx.float().unsqueeze(1) / args.n
            opt.zero_grad()
            (model(x).pow(2).sum() * loader.loss_scale).backward()
            opt.step()
        if session.step_failed:
            continue
        progress.value += 1
        with open(path, "a") as f:
            ids = ",".join(str(i) for i in idx.tolist())
            f.write(f"step {step} {session.rank} {session.world_size} {ids}\n")
    loader.close()
    session.close()


if __name__ == "__main__":
    main()
