"""A wide MLP with Adam and an EMA copy: the size of the training state is a parameter.

The model is ``--layers`` square ``Linear`` layers of one width, chosen so that
the whole state a replacement must receive comes to ``--state-gb`` (decimal
GB, 10^9 bytes): the parameters, Adam's two moments (twice the parameters
again) and an exponential moving average of the parameters (one model-sized
copy, tracked like the model and the optimizer, so it is healed too), all
fp32: 16 bytes per parameter.  ``benchmarks/recovery_at_size.py`` runs it at
0.1 to 2 GB to time a hot-swap whose state transfer is most of the recovery.

With ``--report DIR`` every worker writes ``DIR/<worker>-<pid>.json`` as it
joins a generation and when it ends: the bytes of its tracked state and, for
each generation it joined after its first one (a survivor that re-formed, a
spare that received the state), the peak resident memory from the end of its
last step before to the start of its first step in that generation
(``VmHWM``, reset after every step through ``/proc/self/clear_refs``) next to
its resident memory before, and its resident memory before it built the model
(the interpreter, torch, the runtime), and the duration of its last step
before.  With ``--checksum`` each such entry
also holds digests of the state's structure (names, dtypes, shapes, plain
values) and of its data, taken as the generation starts, so a receiver's
healed state can be compared with its sender's.

Run it on its own (one rank, no ringmaster, no hot-swap)::

    python examples/train_wide.py --state-gb 0.02 --steps 5 --report /tmp/wide

under ``torchrun`` the same way, or as a ringmaster job's ``entrypoint.script``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import time
from typing import Any

import torch
from torch import nn

from agents import runtime

#: fp32 bytes per parameter in the state: the parameter, Adam's two moments, the EMA.
STATE_BYTES_PER_PARAM = 16
#: Rows of input per rank and step: the compute stays small next to the state.
BATCH = 4
EMA_DECAY = 0.99


def width_for(state_bytes: float, layers: int) -> int:
    """The width whose ``layers`` square Linear layers (with bias) hold ``state_bytes``."""
    params = state_bytes / STATE_BYTES_PER_PARAM / layers
    return max(1, int((-1 + math.sqrt(1 + 4 * params)) / 2))  # w * w + w = params


def wide_mlp(width: int, layers: int) -> nn.Sequential:
    parts: list[nn.Module] = []
    for i in range(layers):
        parts.append(nn.Linear(width, width))
        if i < layers - 1:
            parts.append(nn.ReLU())
    return nn.Sequential(*parts)


def tensor_bytes(x: Any) -> int:
    """Bytes of every tensor inside ``x`` (dicts, lists and tuples are walked)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(v) for v in x)
    return 0


def digests(state: Any) -> tuple[str, str]:
    """SHA-256 of ``state``'s structure (paths, dtypes, shapes, plain values) and of
    its tensors' bytes, in a fixed order."""
    structure, data = hashlib.sha256(), hashlib.sha256()

    def walk(path: str, x: Any) -> None:
        if isinstance(x, torch.Tensor):
            structure.update(f"{path}:{x.dtype}:{tuple(x.shape)};".encode())
            flat = x.detach().cpu().contiguous().reshape(-1)
            data.update(flat.view(torch.uint8).numpy().data)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(f"{path}/{k}", x[k])
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{path}/{i}", v)
        else:
            structure.update(f"{path}={x!r};".encode())

    walk("", state)
    return structure.hexdigest(), data.hexdigest()


def _status_bytes(field: str) -> int | None:
    """A memory figure of this process from ``/proc/self/status`` (None where absent)."""
    try:
        with open("/proc/self/status") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def reset_peak() -> bool:
    """Reset this process's peak resident memory (VmHWM) to its current size."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-gb", type=float, default=0.1, help="total state, 10^9 bytes")
    parser.add_argument("--layers", type=int, default=4, help="square Linear layers")
    parser.add_argument("--steps", type=int, default=0, help="0: the job's max_steps")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--report", help="directory: each worker writes its figures here")
    parser.add_argument(
        "--checksum", action="store_true", help="digest the state as each later generation starts"
    )
    args = parser.parse_args()

    width = width_for(args.state_gb * 1e9, args.layers)
    session = runtime.init()
    baseline = _status_bytes("VmRSS")  # the interpreter, torch, the runtime: no state yet
    torch.manual_seed(0)
    net = wide_mlp(width, args.layers).to(session.device)
    ema = copy.deepcopy(net).requires_grad_(False)
    model = session.wrap(net)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    session.track(model=model, optimizer=opt, ema=ema)

    def state() -> dict[str, Any]:
        return {"model": net.state_dict(), "optimizer": opt.state_dict(), "ema": ema.state_dict()}

    heals: list[dict[str, Any]] = []
    generations: list[int] = []

    def write_report() -> None:
        if not args.report:
            return
        os.makedirs(args.report, exist_ok=True)
        figures = {
            "worker": session.worker,
            "pid": os.getpid(),
            "rank": session.rank,
            "generations": generations,
            "steps_done": steps_done,
            "width": width,
            "layers": args.layers,
            "parameters": sum(p.numel() for p in net.parameters()),
            "state_bytes": tensor_bytes(state()),
            "rss_baseline_bytes": baseline,
            "heals": heals,
        }
        path = os.path.join(args.report, f"{session.worker}-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(figures, f)
        os.replace(path + ".tmp", path)  # a reader never sees half a report

    peak_measured = reset_peak()
    rss_before = _status_bytes("VmRSS")
    steps_done = 0
    last_step_s: float | None = None
    loss = torch.tensor(0.0)
    for step in session.steps(args.steps or None):
        started = time.perf_counter()
        if not generations or generations[-1] != session.generation:
            if generations or session.generation > 1:  # joined a later generation
                heal: dict[str, Any] = {
                    "generation": session.generation,
                    "step": step,
                    "rank": session.rank,
                    "peak_rss_bytes": _status_bytes("VmHWM") if peak_measured else None,
                    "rss_before_bytes": rss_before,
                    "last_step_s": last_step_s,  # the one before, for a survivor
                }
                if args.checksum:
                    heal["structure_sha256"], heal["data_sha256"] = digests(state())
                heals.append(heal)
            generations.append(session.generation)
            write_report()  # now: a job may be ended by a signal, not at its last step
        with session.guard():
            g = torch.Generator().manual_seed(step * 1000 + session.rank)
            x = torch.randn(BATCH, width, generator=g).to(session.device)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), net.parameters(), strict=True):
                    e.lerp_(p, 1 - EMA_DECAY)
        if session.step_failed:
            continue  # the step runs again in the next generation
        steps_done += 1
        last_step_s = time.perf_counter() - started
        session.report(loss=loss.item(), samples=BATCH)
        rss_before = _status_bytes("VmRSS")
        reset_peak()
    if session.rank == 0:
        print(f"finished at step {session.step}: width {width}, loss {loss.item():.6f}", flush=True)
    write_report()
    session.close()


if __name__ == "__main__":
    main()
