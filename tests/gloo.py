"""Run a function in N real processes joined by a gloo process group.

Used by the distributed tests: ``run_gloo(fn, world_size, *args)`` spawns
``world_size`` fresh Python processes (``spawn``, so nothing leaks from the
test process), initialises ``torch.distributed`` with gloo over a TCPStore on
a free loopback port, calls ``fn(rank, world_size, *args)`` in each, and
returns the per-rank results in rank order.  ``fn`` must be importable (a
module-level function), as with ``torch.multiprocessing.spawn``.

A rank that raises makes ``run_gloo`` raise ``GlooRunError`` with that rank's
traceback; a run that does not finish within ``timeout`` is killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

from orchestrator.process_lifetime import free_port


class GlooRunError(RuntimeError):
    """A rank failed or the run timed out."""


def answer_and_exit(
    results: Any, answer: object, teardown: Callable[[], None] | None = None
) -> NoReturn:
    """Put a spawned rank's answer on ``results`` (a multiprocessing queue), wait until it
    is sent, run ``teardown`` if given, and end the process without running any
    destructor.

    Freeing a gloo group (``destroy_process_group``, or the interpreter's own exit) joins
    gloo's threads with the GIL held, and a thread still disposing of a finished
    collective's work needs the GIL: the rank never ends (the benchmarks' workers hung
    so).  A rank that tore its group down before answering would then never answer, so
    the answer goes first.
    """
    results.put(answer)
    results.close()
    results.join_thread()
    if teardown is not None:
        with contextlib.suppress(Exception):
            teardown()
    os._exit(0)


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    try:
        import gc

        import torch.distributed as dist

        gc.freeze()  # as agents.runtime.init does: the exit's collection skips the imports
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        answer = (rank, True, fn(rank, world_size, *args))
    except BaseException:
        answer = (rank, False, traceback.format_exc())
    # The answer first (a teardown that hangs costs the run a kill, not its answer), then
    # the group goes as before: a function's peers see this rank leave.
    answer_and_exit(results, answer, teardown=_destroy_groups)


def _destroy_groups() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    base_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, port, args, results, base_env),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty as e:
                raise GlooRunError(
                    f"gloo run timed out after {timeout:g}s; finished ranks: {sorted(out)}"
                ) from e
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise GlooRunError("\n".join(errors))
    return [out[r] for r in range(world_size)]
