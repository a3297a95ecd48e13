"""Durable restore at size: resuming from a checkpoint against a raw read of its bytes.

For each size given (``--sizes 0.1 0.5 1 2``, decimal GB of total state: the
parameters, Adam's two moments and an EMA copy of the parameters tracked as an
object, all fp32; :mod:`_state_at_size`), one process saves a durable
checkpoint of the state with ringmaster's own ``Checkpointer`` (DCP objects,
CRC-32C of each, manifest last) to

* ``file``: a local directory (``file://`` under ``--dir``), and
* ``s3``: moto's S3 API server on 127.0.0.1, started here in a process of its
  own (``ThreadedMotoServer``, as the tests start it, but not sharing this
  process's interpreter lock), reached through s3fs as AWS would be;

then, in the same run, for each backend and each round, side by side:

* restore: ``Checkpointer.restore`` into a freshly built, differently
  initialised state whose optimizer has not stepped (a resuming worker's), from
  a new ``Checkpointer`` on the same URL (built before the clock starts).  It
  includes finding the newest checkpoint (listing, manifest, completeness),
  verifying every object's CRC-32C against the manifest, DCP's load and putting
  the state into the model, optimizer and EMA; the restore's own breakdown
  (``RestoreResult.seconds``) is printed beside it.  The restored state is
  compared with the one saved (a CRC-32C of every tensor) each time;
* raw read: the same files (the manifest, DCP's ``.metadata`` and every
  object the manifest lists) read once, with nothing done to the bytes: plain
  ``readinto`` of each file in turn into one reused buffer (``file``), s3fs's
  ``cat`` of all of them at once (``s3``, its own concurrency).

Local rows run twice: ``cold``, every file of the checkpoint dropped from the
page cache (``posix_fadvise(DONTNEED)``, the files are clean) before each
restore and each raw read, and ``warm``, every file read once before each.
The S3 rows leave the server's own storage as it is (moto keeps large objects
in temporary files: the page cache of this machine serves them in both).
Rounds alternate which of the two runs first; the fastest of each is
reported (interference on a shared machine only ever slows a read down), with
the ratio restore throughput / raw throughput (= raw s / restore s).

A size is left out, with the reason, when the memory available now is less
than about ``MEMORY_FACTOR`` states: the state saved and its staging copy, the
S3 server's copy of an object while it is assembled or served, then the state
restored into and the raw read's bytes.

The last line is one JSON object: a row per size and backend, units, target.

Usage: ``python benchmarks/durable_restore.py [--sizes 0.1 0.5 1 2] [--rounds 2]``;
``--smoke``: 1 MB of state in 2 layers, one round of every row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import fsspec  # noqa: E402
import torch  # noqa: E402
from _state_at_size import build_state, fingerprint, memory_available, state_bytes  # noqa: E402

from benchmarks._smoke import parse, result_line  # noqa: E402
from checkpoint import Checkpointer, CheckpointStorageError, RestoreSource  # noqa: E402
from checkpoint.api import MANIFEST_NAME  # noqa: E402
from orchestrator.process_lifetime import free_port  # noqa: E402
from tests.faults.s3_credentials import use_test_credentials  # noqa: E402

#: States of memory a size needs (see the module's docstring), and what is left to others.
MEMORY_FACTOR = 4.5
MEMORY_SPARE_BYTES = 2 << 30
BUCKET = "ringmaster-bench"
#: Buffer the local raw read reads into, reused for every file.
RAW_BUFFER_BYTES = 64 << 20
STEP = 1
SAVE_TIMEOUT = timedelta(minutes=20)
UNITS = {
    "state_gb": "10^9 bytes",
    "_bytes": "bytes",
    "_s": "seconds",
    "_mb_per_s": "10^6 bytes per second",
    "ratio": "restore throughput / raw read throughput of the same bytes (raw_s / restore_s)",
}
TARGET = {"ratio_at_least": 0.8}
#: ``--smoke``: the least state and one round of each row.
SMOKE = {"sizes": [0.001], "layers": 2, "rounds": 1}
#: The moto server, run in a process of its own; it prints ``ready`` once it listens.
_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""


@dataclass
class Backend:
    """Where one row's checkpoint lives and how its files are read raw."""

    name: str
    cache: str
    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def fs(self) -> fsspec.AbstractFileSystem:
        fs, _ = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **self.storage_options)
        return fs


@contextmanager
def s3_server() -> Iterator[dict[str, Any]]:
    """moto's S3 server on a free loopback port with one bucket; yields storage options."""
    use_test_credentials()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # its request log
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {
                "endpoint_url": f"http://127.0.0.1:{port}",
                "region_name": "us-east-1",
            },
        }
        import boto3

        boto3.client(
            "s3",
            endpoint_url=options["client_kwargs"]["endpoint_url"],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=BUCKET)
        yield options
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def checkpoint_files(backend: Backend) -> list[str]:
    """The files a restore reads: manifest, DCP's metadata, the objects (filesystem paths)."""
    ckpt = Checkpointer(backend.url, storage_options=backend.storage_options, check_storage=False)
    info = ckpt.latest()
    assert info is not None and info.manifest is not None, f"nothing committed at {backend.url}"
    directory = ckpt.root.child(info.name)
    names = [MANIFEST_NAME, ".metadata", *(o.path for o in info.manifest.objects)]
    return [directory.path(n) for n in names]


def set_cache(backend: Backend, files: list[str]) -> None:
    """Put the checkpoint's local files in the state the row reads them in."""
    if backend.cache == "cold":
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    elif backend.cache == "warm":
        raw_read(backend, files)


def raw_read(backend: Backend, files: list[str]) -> int:
    """Read ``files`` once, doing nothing with the bytes; returns the bytes read."""
    if backend.name == "s3":
        return sum(len(b) for b in backend.fs().cat(files).values())
    buf = bytearray(RAW_BUFFER_BYTES)
    view = memoryview(buf)
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def timed_raw(backend: Backend, files: list[str]) -> dict[str, Any]:
    set_cache(backend, files)
    gc.collect()
    started = time.perf_counter()
    nbytes = raw_read(backend, files)
    return {"raw_s": time.perf_counter() - started, "raw_bytes": nbytes}


def timed_restore(backend: Backend, files: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Restore into a fresh state (built untimed) and check it equals the one saved."""
    state = build_state(args.size, args.layers, seed=1, stepped=False)
    ckpt = Checkpointer(backend.url, storage_options=backend.storage_options, keep=1)
    set_cache(backend, files)
    gc.collect()
    started = time.perf_counter()
    result = ckpt.restore(state)
    elapsed = time.perf_counter() - started
    ckpt.close()
    assert result.source is RestoreSource.DURABLE and result.step == STEP, result
    equal = fingerprint(state) == args.saved_fingerprint
    assert equal, f"the state restored from {backend.url} differs from the one saved"
    return {"restore_s": elapsed, "phases": dict(result.seconds), "equal": equal}


def measure(backend: Backend, args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` pairs of a restore and a raw read, alternating which goes first."""
    files = checkpoint_files(backend)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        both: list[Callable[[], dict[str, Any]]] = [
            lambda: timed_raw(backend, files),
            lambda: timed_restore(backend, files, args),
        ]
        r: dict[str, Any] = {"raw_first": i % 2 == 0}
        for run in both if r["raw_first"] else both[::-1]:
            r.update(run())
        r["ratio"] = r["raw_s"] / r["restore_s"]
        rounds.append(r)
    best_restore = min(rounds, key=lambda r: r["restore_s"])
    best_raw = min(r["raw_s"] for r in rounds)
    nbytes = rounds[0]["raw_bytes"]
    return {
        "state_gb": args.size,
        "backend": backend.name,
        "cache": backend.cache,
        "state_bytes": args.state_bytes,
        "checkpoint_bytes": nbytes,
        "restore_s": best_restore["restore_s"],
        "raw_s": best_raw,
        "restore_mb_per_s": nbytes / best_restore["restore_s"] / 1e6,
        "raw_mb_per_s": nbytes / best_raw / 1e6,
        "ratio": best_raw / best_restore["restore_s"],
        "ratio_rounds": [round(r["ratio"], 3) for r in rounds],
        "restore_phases_s": {k: round(v, 4) for k, v in best_restore["phases"].items()},
        "restored_equal_saved": all(r["equal"] for r in rounds),
    }


def print_row(row: dict[str, Any]) -> None:
    if "skipped" in row:
        print(
            f"{row['state_gb']:g} GB {row.get('backend', '')}: not run: {row['skipped']}",
            flush=True,
        )
        return
    phases = ", ".join(f"{k} {v:.2f}" for k, v in row["restore_phases_s"].items())
    print(
        f"{row['state_gb']:g} GB {row['backend']:>4} {row['cache']:<5} "
        f"({row['checkpoint_bytes'] / 1e6:.0f} MB read): restore {row['restore_s']:.2f} s "
        f"({row['restore_mb_per_s']:.0f} MB/s) | raw {row['raw_s']:.2f} s "
        f"({row['raw_mb_per_s']:.0f} MB/s) | ratio {row['ratio']:.2f} "
        f"(rounds {row['ratio_rounds']}) | restore: {phases}",
        flush=True,
    )


def run_size(args: argparse.Namespace, s3_options: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Save one state of ``args.size`` to each backend, then measure each backend's rows."""
    workdir = Path(tempfile.mkdtemp(prefix="rm-bench-restore-", dir=args.dir))
    tag = f"size-{args.size:g}".replace(".", "-")
    backends = [Backend("file", cache, f"file://{workdir}/ckpt") for cache in args.cache]
    if s3_options is not None:
        backends.append(Backend("s3", "-", f"s3://{BUCKET}/{tag}", s3_options))
    try:
        saved = build_state(args.size, args.layers, seed=0, stepped=True)
        args.state_bytes = state_bytes(saved)
        args.saved_fingerprint = fingerprint(saved)
        refused: dict[str, str] = {}
        for url, options in {(b.url, json.dumps(b.storage_options)) for b in backends}:
            ckpt = Checkpointer(url, storage_options=json.loads(options), keep=1)
            try:
                ckpt.save_now(STEP, saved, timeout=SAVE_TIMEOUT)
            except CheckpointStorageError as e:  # moto's server may refuse an object this large
                refused[url] = f"the save was refused: {e}"
            ckpt.close()
        del saved
        gc.collect()
        rows = []
        for backend in backends:
            if backend.url in refused:
                row = {
                    "state_gb": args.size,
                    "backend": backend.name,
                    "skipped": refused[backend.url],
                }
            else:
                row = {
                    k: round(v, 4) if isinstance(v, float) else v
                    for k, v in measure(backend, args).items()
                }
            print_row(row)
            rows.append(row)
        if s3_options is not None:
            backends[-1].fs().rm(f"{BUCKET}/{tag}", recursive=True)
        return rows
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=float, nargs="+", default=[0.1], help="total state, 10^9 bytes each"
    )
    parser.add_argument("--layers", type=int, default=4, help="square Linear layers of the model")
    parser.add_argument("--rounds", type=int, default=2, help="restore + raw read pairs per row")
    parser.add_argument(
        "--cache",
        nargs="+",
        default=["cold", "warm"],
        choices=["cold", "warm"],
        help="page cache states of the local rows",
    )
    parser.add_argument("--no-s3", action="store_true", help="local rows only")
    parser.add_argument("--dir", default=None, help="where the local checkpoints go (a temp dir)")
    args = parse(parser, SMOKE)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows: list[dict[str, Any]] = []
    with s3_server() if not args.no_s3 else _no_server() as s3_options:
        for size in args.sizes:
            need, free = int(MEMORY_FACTOR * size * 1e9) + MEMORY_SPARE_BYTES, memory_available()
            if need > free:
                row = {
                    "state_gb": size,
                    "skipped": f"needs about {need / 2**30:.1f} GiB of memory, "
                    f"{free / 2**30:.1f} GiB available",
                }
                print_row(row)
                rows.append(row)
                continue
            args.size = size
            rows += run_size(args, s3_options)
    print(
        result_line(
            {
                "sizes_gb": args.sizes,
                "rounds": args.rounds,
                "writer_threads": 1,
                "checksum": "crc32c",
                "s3": "moto server on 127.0.0.1 (own process), s3fs",
                "rows": rows,
                "units": UNITS,
                "target": TARGET,
            },
            args.smoke,
        )
    )


@contextmanager
def _no_server() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    main()
