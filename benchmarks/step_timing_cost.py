"""What timing the steps costs a worker, measured inside one process.

A job's step rate on a shared machine drifts by more than the 0.5 % of a
50 ms step that step timing may cost, so comparing whole jobs cannot show
that bound.  This measures the cost where it is paid, in one process:

* ``calls``: the clock reads and additions of
  :class:`~agents.runtime.step_timing.StepTiming` alone, nanoseconds per
  bucket posted, per bucket completed and per step (a million each);
* ``ddp``: a real DDP step (gloo, one rank, a model of ``--buckets`` gradient
  buckets) through the runtime's own comm hook
  (:meth:`~agents.runtime.failures.CollectiveFailures.allreduce_hook`), with
  a :class:`StepTiming` fed against none, in alternating blocks of steps.
  The difference of the median step times of each pair of neighbouring
  blocks is one sample; the row gives their median and quartiles, in
  microseconds per step and in percent of a 50 ms step, and how many
  buckets a step posted.

Run alone (``python benchmarks/step_timing_cost.py``) or as the ``cost`` row of
``benchmarks/stragglers.py``.  The last line is one JSON object.  ``--smoke``: a
thousand calls each, 4 pairs of 5-step blocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agents.runtime.failures import CollectiveFailures  # noqa: E402
from agents.runtime.step_timing import StepTiming  # noqa: E402
from benchmarks._smoke import parse, result_line  # noqa: E402

__all__ = ["SMOKE", "call_costs", "ddp_cost"]

#: The step the target is stated against: 0.5 % of it is 250 µs.
STEP_S = 0.05
#: ``--smoke``: calls timed per kind (``call_costs``), steps per block and pairs (``ddp_cost``).
SMOKE = {"number": 1000, "block": 5, "pairs": 4}


def call_costs(number: int = 1_000_000) -> dict[str, float]:
    """Nanoseconds per ``posted``, ``completed`` and ``step_done`` (best of 5)."""
    timing = StepTiming()
    out: dict[str, float] = {}
    for name, call in (("posted", timing.posted), ("completed", timing.completed)):
        best = min(timeit.repeat(call, number=number, repeat=5))
        out[f"{name}_ns"] = round(best / number * 1e9, 1)

    def step() -> None:
        timing.posted()
        timing.completed()
        timing.step_done()

    whole = min(timeit.repeat(step, number=number, repeat=5)) / number * 1e9
    out["step_done_ns"] = round(whole - out["posted_ns"] - out["completed_ns"], 1)
    return out


def ddp_cost(buckets: int = 4, block: int = 200, pairs: int = 30) -> dict[str, Any]:
    """A DDP step's time with and without a :class:`StepTiming` fed by its comm hook.

    The model is small (``buckets`` layers of 64 x 64, one gradient bucket each) so
    that a step takes well under a millisecond: what the timing adds is then not
    lost in the step's own spread.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        width = 64
        timings: dict[str, StepTiming | None] = {"off": None, "timed": StepTiming()}
        models: dict[str, DDP] = {}
        for name, timing in timings.items():
            net = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(buckets)])
            ddp = DDP(net, bucket_cap_mb=width * width * 4 / 2**20)  # one layer a bucket
            DDP.register_comm_hook(ddp, None, CollectiveFailures(timing).allreduce_hook())
            models[name] = ddp
        x = torch.randn(8, width)

        def steps(name: str, n: int) -> float:
            """The median time of ``n`` steps (a median: other processes' bursts drop out)."""
            ddp, timing = models[name], timings[name]  # the session ends each timed step
            times = []
            for _ in range(n):
                start = time.perf_counter()
                ddp(x).sum().backward()
                if timing is not None:
                    timing.step_done()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        for name in models:
            steps(name, block)  # warm up both (DDP rebuilds its buckets after the first)
        sizes = models["timed"]._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
        diffs: list[float] = []
        base: list[float] = []
        for i in range(pairs):
            order = ("off", "timed") if i % 2 == 0 else ("timed", "off")
            t = {name: steps(name, block) for name in order}
            diffs.append(t["timed"] - t["off"])
            base.append(t["off"])
        q1, med, q3 = statistics.quantiles(diffs, n=4)
        return {
            "buckets_per_step": len(str(sizes).split(",")) if sizes else None,
            "steps_per_block": block,
            "pairs": pairs,
            "step_off_us": round(statistics.median(base) * 1e6, 1),
            "extra_us_median": round(med * 1e6, 2),
            "extra_us_q1": round(q1 * 1e6, 2),
            "extra_us_q3": round(q3 * 1e6, 2),
            "pct_of_50ms_step": round(100.0 * med / STEP_S, 4),
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--block", type=int, default=200, help="steps per block")
    parser.add_argument("--number", type=int, default=1_000_000, help="calls timed per kind")
    args = parse(parser, SMOKE)
    figures = {
        "calls": call_costs(args.number),
        "ddp": ddp_cost(args.buckets, block=args.block, pairs=args.pairs),
    }
    print(f"calls: {figures['calls']}\nddp: {figures['ddp']}", flush=True)
    print(result_line(figures, args.smoke))


if __name__ == "__main__":
    main()
