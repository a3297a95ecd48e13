"""A worker of tests/integration/test_diloco_rounds.py: examples/train_tiny.py's model and
data under the job's delayed sync, where the nodes named by ``--slow`` take ``--slow-time``
more seconds a step.  At the end every worker writes ``OUT_DIR/<worker>.json``: its node,
its outer steps per fragment, the outer steps its site was left out of, and its final
parameters.

Arguments: --out-dir DIR [--slow NODE ...] [--slow-time SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the examples beside the tests

from agents import runtime
from examples.train_tiny import CLASSES, FEATURES, dataset, train_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--slow", nargs="*", default=[])
    p.add_argument("--slow-time", type=float, default=0.0)
    a = p.parse_args()
    torch.manual_seed(0)
    node = os.environ.get("RINGMASTER_NODE", "")
    pause = a.slow_time if node in a.slow else 0.0
    session = runtime.init()
    x, y = dataset()
    model = session.wrap(nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    session.track(model=model, optimizer=opt)
    for step in session.steps():
        with session.guard():
            train_step(session, model, opt, step, x, y)
            time.sleep(pause)
    if session.finished:
        flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        record = {
            "node": node,
            "outer_steps": list(session.outer_steps),
            "left_out": session.outer_left_out,
            "params": flat.tolist(),
        }
        (a.out_dir / f"{session.worker}.json").write_text(json.dumps(record))
    session.close()


if __name__ == "__main__":
    main()
