"""The straggler benchmark's entrypoint: an example script, its applied steps logged,
and on request a garbage-collection pause storm inside one worker.

Usage (as a job's ``entrypoint.script``)::

    _noisy_worker.py --step-log DIR [--slow FILE] [--gc-storm FILE] examples/train_lm.py ARGS...

The example runs unchanged (as ``__main__``, its own directory first on
``sys.path``, as ``python examples/train_lm.py`` would).  Three things are added
from outside it, for the benchmark only:

* ``--step-log DIR``: every step this worker applied (the loop body of
  ``session.steps()`` ran and the step did not fail) is logged as ``STEP TIME``
  to ``DIR/<worker>-<pid>.log``: steps applied twice or never are counted from
  these, and the step rate from their times;
* ``--slow FILE``: once ``FILE`` exists and holds ``NODE FACTOR HOW``, every
  worker of ``NODE`` makes each of its steps last ``FACTOR`` times as long: at
  the start of the step, before its body, for ``FACTOR - 1`` times what its
  steps take (a moving average over its last steps, their stretch left out),
  it either stalls (``HOW`` is ``stall``: it sleeps that long in wall-clock
  time, as a host waits on a slow device: the step takes longer and the CPU is
  free for others) or works (``work``: it spins for that much of its own
  thread's CPU time, as a slow CPU does the same work slower; on CPUs shared by
  every node, as here, the spin also takes CPU from the peers while they
  compute).  At the start, as a slow device's compute is: the peers wait for
  it in the step's collectives (the forward's buffer broadcast, the gradient
  reduction, a sharded model's all-gathers), not in the vote at the step
  boundary.  The file is read again whenever it changes: the benchmark adjusts
  ``FACTOR`` until the node's measured slowdown is the nominal one
  (``benchmarks/_straggler_slowdown.py``);
* ``--gc-storm FILE``: a thread waits until ``FILE`` exists.  It holds
  ``NODE SEED`` (written by the benchmark once the job trains); the worker of
  local rank 0 on ``NODE`` then pauses its own Python, as a garbage-collection
  storm would: at random moments (one every 2 s on average, seeded) a full
  ``gc.collect()`` over a cyclic object graph kept for it, then the interpreter lock
  held in one C call until the pause has lasted its drawn length (20 to 300 ms
  of a core to itself: on a busy core it lasts longer, as a collection would).
  While the lock is held the training loop's Python stops, as it does under a
  real collection of a large heap.  Each pause's length (wall clock) is
  appended to ``FILE.pauses``.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import runpy
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: a pause's length (seconds), drawn uniformly, and the mean gap between pauses
PAUSE_S = (0.02, 0.3)
MEAN_GAP_S = 2.0
#: the cyclic object graph each pause's collection walks (objects)
GARBAGE = 20_000
#: a slow node's step time is averaged over its steps with this weight for the newest
AVERAGE = 0.2


def _log_steps(session: Any, log_dir: str, slow: Path | None, node: str) -> None:
    """Wrap ``session.steps``: every applied step logged with its time, and the
    step stretched while ``slow`` names this node (see the module docstring)."""
    steps = session.steps
    path = Path(log_dir) / f"{session.worker}-{os.getpid()}.log"
    factor, how, seen = [1.0], ["stall"], [0]  # this node's factor, how, the mtime read

    def stretch(cpu: float, wall: float) -> None:
        if slow is not None and slow.exists() and slow.stat().st_mtime_ns != seen[0]:
            seen[0] = slow.stat().st_mtime_ns
            target, value, how[0] = slow.read_text().split()  # written whole (a rename)
            factor[0] = float(value) if target == node else 1.0
        if factor[0] <= 1.0:
            return
        if how[0] == "stall":
            time.sleep((factor[0] - 1.0) * wall)
            return
        end = time.thread_time() + (factor[0] - 1.0) * cpu
        while time.thread_time() < end:
            pass

    def logged(total: int | None = None) -> Iterator[int]:
        inner = steps(total)
        took: tuple[float, float] | None = None  # a step's CPU and wall time, averaged
        try:
            with path.open("a") as log:
                for step in inner:
                    if took is not None:
                        stretch(*took)
                    cpu, wall = time.thread_time(), time.monotonic()
                    yield step
                    now = (time.thread_time() - cpu, time.monotonic() - wall)
                    took = (
                        now
                        if took is None
                        else (_average(took[0], now[0]), _average(took[1], now[1]))
                    )
                    if not session.step_failed:
                        log.write(f"{step} {time.time()}\n")
                        log.flush()
        finally:
            inner.close()

    session.steps = logged


def _average(average: float, value: float) -> float:
    """A moving average's next value (weight :data:`AVERAGE` for the newest)."""
    return AVERAGE * value + (1.0 - AVERAGE) * average


def _hold_the_lock(seconds: float, per_second: float) -> None:
    """Hold the interpreter lock for about ``seconds``: one C-level loop."""
    sum(range(max(1, int(seconds * per_second))))


def _loop_rate() -> float:
    """Iterations per second of :func:`_hold_the_lock`'s loop on this machine."""
    n = 2_000_000
    start = time.perf_counter()
    sum(range(n))
    return n / max(time.perf_counter() - start, 1e-6)


def _storm(trigger: Path, node: str) -> None:
    while not trigger.exists():
        time.sleep(0.2)
    target, seed = trigger.read_text().split()
    if target != node:
        return
    rng = random.Random(int(seed))
    per_second = _loop_rate()
    heap: list[Any] = []  # a cyclic object graph that every full collection walks
    for _ in range(GARBAGE):
        heap.append([heap])
    with trigger.with_suffix(".pauses").open("a") as log:
        while True:
            time.sleep(rng.expovariate(1.0 / MEAN_GAP_S))
            length = rng.uniform(*PAUSE_S)
            start = time.perf_counter()
            gc.collect()
            _hold_the_lock(length - (time.perf_counter() - start), per_second)
            log.write(f"{time.perf_counter() - start:.4f}\n")
            log.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step-log", required=True, help="directory of the step logs")
    parser.add_argument("--gc-storm", help="file naming the node whose worker pauses")
    parser.add_argument("--slow", help="file naming the node whose steps are stretched")
    parser.add_argument("script", help="the example script, then its arguments")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    # the example's directory first, as for ``python SCRIPT``, and not this one's (its
    # benchmarks would shadow the project's packages: ``checkpoint``)
    script = str(Path(args.script).resolve())
    sys.path[0] = str(Path(script).parent)

    from agents import runtime
    from agents.api import ENV_LOCAL_RANK, ENV_NODE

    init = runtime.init
    node = os.environ.get(ENV_NODE, "")
    slow = Path(args.slow) if args.slow else None

    def logged_init(*a: Any, **k: Any) -> Any:
        session = init(*a, **k)
        _log_steps(session, args.step_log, slow, node)
        return session

    runtime.init = logged_init
    if args.gc_storm and os.environ.get(ENV_LOCAL_RANK, "0") == "0":
        threading.Thread(
            target=_storm, args=(Path(args.gc_storm), node), daemon=True, name="gc-storm"
        ).start()
    sys.argv = [script, *args.args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
