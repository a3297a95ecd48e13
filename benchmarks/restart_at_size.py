"""The restart tier at real state sizes: a torchrun script that loads its own checkpoint.

For each size given (``--sizes 0.1 0.5 1 2``, decimal GB of state: the
parameters and Adam's two moments, fp32, 12 bytes per parameter),
``examples/train_torchrun.py`` runs unmodified with one ``--width`` x
``--width`` hidden layer sized to it, ``--optimizer adam``, 2 samples per
rank and step (a step's compute stays small next to the state) and a
``torch.save`` checkpoint every ``CHECKPOINT_EVERY`` steps (rank 0 writes a
temporary file and renames it; every rank ``torch.load``\\ s the newest at
start).  The same script runs twice per size, one after the other, as
``recovery.py --tier0`` runs it (:mod:`_restart_runs`): under ringmaster's
restart tier (2 nodes + 1 warm spare) and under stock torchrun
(``--nnodes=2:3``, c10d store in its own process: the three agents train
until the kill, the two survivors re-form).  In both the node of rank
``VICTIM_RANK`` (1: not the node whose torchrun agent hosts the workers'
store, a loss stock torchrun did not recover from here) is SIGKILLed, agent
and worker, once the job has logged step ``KILL_AT`` (``KILL_AT -
CHECKPOINT_EVERY`` steps after its newest checkpoint: the same steps lost in
both).  One compute thread per worker.  Per size and run:

* seconds from the SIGKILL to the first step completed by a worker started
  after it, and the ratio torchrun / ringmaster; the machine's load average
  as each run started (it is shared);
* where the new rank 0 spent them, from the script's own start log
  (``rank-0.starts``): to its ``main()`` (detection, relaunch, and under
  torchrun the process's start and ``import torch``), the process group,
  building the model, ``torch.load`` of the checkpoint (the script's own
  load), ``load_state_dict``, DDP's construction (it broadcasts rank 0's
  parameters) and the first step; the slowest new worker's ``torch.load``;
  and ringmaster's own phases (its ``Recovered`` event: detect and relaunch,
  from the survivor's first report of the break).

The checkpoint is written on this machine, so it is in this machine's page
cache when the new workers read it.  On several machines the new workers read
it from shared storage that their machines did not write: ``--cold`` makes
that so here, by flushing every new checkpoint file to disk and dropping it
from the page cache as soon as it is renamed into place (``fsync``,
``POSIX_FADV_DONTNEED``; both runs alike); each row says how long after its
last write a checkpoint was dropped, at most.

A size whose job could not fit in the memory available now (about
``MEMORY_FACTOR`` times the state, see :func:`memory_needed`) is left out,
with the reason.  The last line is one JSON object: a row per size, the
units, the target.

Usage: ``python benchmarks/restart_at_size.py [--sizes 0.1 0.5 1 2] [--cold]``;
``--smoke``: 1 MB of state, ``--cold``, torchrun given ``SMOKE_PATIENCE_S`` to train
again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.etcd.grpc_env import apply_grpc_environment  # noqa: E402

# before gRPC is imported: this process forks agents (see orchestrator.etcd.grpc_env)
apply_grpc_environment()

import _restart_runs  # noqa: E402
from _state_at_size import skipped_for_memory  # noqa: E402

from benchmarks._smoke import parse, result_line  # noqa: E402

#: fp32 bytes per parameter in the state: the parameter and Adam's two moments.
STATE_BYTES_PER_PARAM = 12
#: train_torchrun.py's input features and classes (its first and last layers).
FEATURES, CLASSES = 16, 4
CHECKPOINT_EVERY = 5
#: Killed once this step is logged: 3 steps after the checkpoint at step 5.
KILL_AT = 8
#: The rank whose node is killed: not rank 0's, whose torchrun agent hosts the
#: workers' store (stock torchrun did not recover from that loss here).
VICTIM_RANK = 1
#: Memory a size needs, in states: under torchrun three workers train, each with its
#: parameters, gradients, DDP's buckets, Adam's moments and its step's temporaries
#: (about 2.3 states; while it loads, the checkpoint's copy instead of the gradients).
MEMORY_FACTOR = 7.5
#: Memory left to the rest of the machine (etcd, agents, the controller, others).
MEMORY_SPARE_BYTES = 2 << 30
#: The new rank 0's phases, from its start log: (name, from, to).
PHASES = (
    ("to_main", "killed", "main"),
    ("process_group", "main", "group"),
    ("build", "group", "built"),
    ("load", "built", "read"),
    ("load_state_dict", "read", "loaded"),
    ("ddp", "loaded", "ddp"),
    ("first_step", "ddp", "step"),
)
UNITS = {
    "state_gb": "10^9 bytes",
    "_bytes": "bytes",
    "_s": "seconds",
    "ratio": "torchrun's seconds / ringmaster's",
    "_load_average": "runnable processes, 1-minute mean, as the run started",
}
TARGET = {"ratio_at_1_gb_at_least": 3.0}
#: ``--smoke``: the least state, the cold path; torchrun's time to train again.
SMOKE = {"sizes": [0.001], "cold": True}
SMOKE_PATIENCE_S = 30.0


def width_for(state_bytes: float) -> int:
    """The hidden width whose model (16 -> W -> W -> 4, with biases) and Adam state
    hold ``state_bytes``: W*W + 22*W + 4 parameters."""
    params = state_bytes / STATE_BYTES_PER_PARAM
    return max(1, int(-11 + math.sqrt(121 - 4 + params)))


def parameters(width: int) -> int:
    w = width
    return (FEATURES + 1) * w + (w + 1) * w + (w + 1) * CLASSES


def memory_needed(state_bytes: float) -> int:
    """Bytes a job of ``state_bytes`` needs free (see :data:`MEMORY_FACTOR`)."""
    return int(MEMORY_FACTOR * state_bytes) + MEMORY_SPARE_BYTES


def script_args(width: int) -> list[str]:
    return [
        *("--width", str(width), "--hidden-layers", "1", "--optimizer", "adam"),
        *("--batch-size", "2", "--epochs", "1"),
        *("--checkpoint-every", str(CHECKPOINT_EVERY)),
    ]


class ColdCheckpoints:
    """Keeps the script's checkpoints out of this machine's page cache (``--cold``).

    A thread flushes every file under ``directory`` to disk as it is written
    (so little is dirty when it is renamed into place) and drops each
    finished checkpoint (``ckpt-*.pt``) from the page cache once, as soon as
    it appears; :attr:`dropped_after` holds, per checkpoint, the seconds from
    its last write to its drop.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.dropped_after: list[float] = []
        self._done: set[tuple[int, int, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ColdCheckpoints:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            for f in self.directory.rglob("ckpt-*"):
                try:
                    self._flush(f)
                except OSError:
                    continue  # renamed or removed meanwhile

    def _flush(self, f: Path) -> None:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            st = os.fstat(fd)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if f.suffix == ".pt" and key not in self._done:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                self._done.add(key)
                self.dropped_after.append(time.time() - st.st_mtime)
        finally:
            os.close(fd)


def _phases(logs: Path, killed_at: float) -> dict[str, Any]:
    """Where the new workers spent the time from the kill to their first step."""
    starts = {}
    for f in logs.glob("rank-*.starts"):
        rank = int(f.stem.removeprefix("rank-"))
        for line in f.read_text().splitlines():
            entry = json.loads(line)
            if entry["main"] > killed_at:
                starts[rank] = entry
    steps = {p: t for t, _, p in reversed(_restart_runs.step_entries(logs)) if t > killed_at}
    out: dict[str, Any] = {}
    if 0 in starts:
        times = {**starts[0], "killed": killed_at, "step": steps.get(starts[0]["pid"])}
        for name, a, b in PHASES:
            if times.get(a) is not None and times.get(b) is not None:
                out[f"{name}_s"] = times[b] - times[a]
    loads = [s["read"] - s["built"] for s in starts.values()]
    out["load_max_s"] = max(loads) if loads else None
    return out


def run_size(
    size_gb: float, cold: bool, patience: float = _restart_runs.TORCHRUN_PATIENCE_S
) -> dict[str, Any]:
    """Both runs at one size; the row (torchrun has ``patience`` seconds after the kill
    to train again)."""
    width = width_for(size_gb * 1e9)
    params = parameters(width)
    args = script_args(width)
    row: dict[str, Any] = {
        "state_gb": size_gb,
        "width": width,
        "parameters": params,
        "state_bytes": params * STATE_BYTES_PER_PARAM,
        "cold": cold,
    }
    for name in ("ringmaster", "torchrun"):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            (tmp / "ckpt").mkdir()
            cold_files = ColdCheckpoints(tmp / "ckpt") if cold else None
            row[f"{name}_load_average"] = os.getloadavg()[0]  # the machine is shared
            with cold_files or contextlib.nullcontext():
                if name == "ringmaster":
                    got = _restart_runs.run_ringmaster(
                        tmp,
                        f"restart-{width}",
                        args,
                        KILL_AT,
                        until_recovered=True,
                        env={"OMP_NUM_THREADS": "1"},
                        victim_rank=VICTIM_RANK,
                    )
                else:
                    got = _restart_runs.run_torchrun(
                        tmp, args, KILL_AT, patience=patience, victim_rank=VICTIM_RANK
                    )
            files = sorted((tmp / "ckpt").rglob("ckpt-*.pt"))
            if files:
                row["checkpoint_bytes"] = files[-1].stat().st_size
            row[f"{name}_s"] = got.pop("recovery_s")
            row[f"{name}_steps_lost"] = got.pop("steps_lost")
            killed_at = got.pop("killed_at")
            if "why" in got:  # torchrun did not train again: its agents' last errors
                row[f"{name}_last_errors"] = got.pop("why")
                row[f"{name}_restart_counts"] = got.pop("restart_counts")
            # ringmaster's own phases (its Recovered event), from the failure it saw first
            row.update({f"{name}_event_{key}": value for key, value in got.items()})
            for key, value in _phases(tmp / "steps", killed_at).items():
                row[f"{name}_{key}"] = value
            if cold_files is not None:
                dropped = cold_files.dropped_after
                row[f"{name}_dropped_after_max_s"] = max(dropped) if dropped else None
    recovered = row["torchrun_s"] != float("inf")
    row["ratio"] = row["torchrun_s"] / row["ringmaster_s"] if recovered else None
    if not recovered:
        row["torchrun_s"] = None
        row["ratio_at_least"] = patience / row["ringmaster_s"]
    return row


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def _print_row(row: dict[str, Any]) -> None:
    if "skipped" in row:
        print(f"{row['state_gb']:g} GB: not run: {row['skipped']}", flush=True)
        return
    ckpt = row.get("checkpoint_bytes", 0) / 1e9
    tr = "no step" if row["torchrun_s"] is None else f"{row['torchrun_s']:.2f}s"
    ratio = (
        f"{row['ratio']:.1f}x" if row["ratio"] is not None else f">= {row['ratio_at_least']:.1f}x"
    )
    print(
        f"{row['state_gb']:g} GB (width {row['width']}, checkpoint {ckpt:.2f} GB"
        f"{', cold' if row['cold'] else ''}): ringmaster {row['ringmaster_s']:.2f}s, "
        f"torchrun {tr} to the next step ({ratio})",
        flush=True,
    )
    for name in ("ringmaster", "torchrun"):
        parts = [
            f"{phase} {row[f'{name}_{phase}_s']:.2f}s"
            for phase, _, _ in PHASES
            if row.get(f"{name}_{phase}_s") is not None
        ]
        print(
            f"    {name:10s} new rank 0: {', '.join(parts)} (load average "
            f"{row[f'{name}_load_average']:.1f})",
            flush=True,
        )
    for line in row.get("torchrun_last_errors", []):
        print(f"    torchrun did not train again: {line}", flush=True)
    counts = row.get("torchrun_restart_counts")
    if counts and len(set(counts.values())) > 1:
        print(
            f"    torchrun's agents disagree on their restart count ({counts}): their new "
            "workers wait for each other under different store prefixes",
            flush=True,
        )
    if row.get("ringmaster_event_detect_s") is not None:
        print(
            f"    ringmaster's Recovered event, from the failure it saw first: detect "
            f"{row['ringmaster_event_detect_s']:.2f}s, relaunch "
            f"{row['ringmaster_event_relaunch_s']:.2f}s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=float, nargs="+", default=[0.1], help="state, 10^9 bytes each"
    )
    parser.add_argument(
        "--cold", action="store_true", help="drop each checkpoint from the page cache"
    )
    args = parse(parser, SMOKE)
    patience = SMOKE_PATIENCE_S if args.smoke else _restart_runs.TORCHRUN_PATIENCE_S
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        skipped = skipped_for_memory(size, memory_needed(size * 1e9))
        if skipped is not None:
            row: dict[str, Any] = skipped
        else:
            row = run_size(size, args.cold, patience)
        row = _rounded(row)
        _print_row(row)
        rows.append(row)
    print(
        result_line(
            {
                "sizes_gb": args.sizes,
                "nodes": 2,
                "spares": 1,
                "checkpoint_every": CHECKPOINT_EVERY,
                "kill_at": KILL_AT,
                "cold": args.cold,
                "rows": rows,
                "units": UNITS,
                "target": TARGET,
            },
            args.smoke,
        )
    )


if __name__ == "__main__":
    main()
