"""A job on a three-member etcd cluster: one member SIGKILLed, then the quorum lost.

One run of the tiny job (2 active nodes, 1 spare, local processes) on
:class:`tests.faults.etcd_cluster.EtcdCluster`:

1. at step 30 one member is SIGKILLed (whether it was the raft leader is
   reported): the longest gap between two training steps around it, next to
   the median step time;
2. at step 60 a second member is SIGKILLed (no quorum) for ``OUTAGE_S``
   seconds, then both come back: how many steps the job trained after the
   quorum was lost before the workers paused, and how long after the cluster
   was healthy again the next step completed;
3. steps applied twice or never (both must be 0);
4. how many times a worker paused for etcd while one member was down (must
   be 0: one member down is invisible) and after the quorum was lost.

Every wait has a deadline and fails loudly with the job's last output.  The
last line is a JSON object.  ``--smoke``: the same faults at steps 10, 20 and 25
of 150 steps of 20 ms, the quorum lost for 2 s.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._smoke import parse, result_line  # noqa: E402
from orchestrator.api import JobPhase  # noqa: E402
from orchestrator.etcd.options import EtcdOptions  # noqa: E402
from orchestrator.state import jobs  # noqa: E402
from tests.chaos.jobs import quiet_run, tiny_job  # noqa: E402
from tests.faults.etcd_cluster import EtcdCluster  # noqa: E402

#: Long enough that the job is still training when the quorum is lost and for the
#: seconds workers take to notice (the status's step trails the workers by a second
#: or two, so "at step 60" is later for them): at 120 the job could end inside the
#: outage, never pausing.
STEPS = 400
OUTAGE_S = 6.0


#: Longest wait for the job to reach a step before the benchmark fails.
STEP_DEADLINE_S = 90.0
#: Longest the whole job may run before the benchmark fails.
RUN_DEADLINE = timedelta(minutes=5)
#: What a worker logs when it pauses for etcd.
PAUSE_LINE = "pausing until etcd is back"


@dataclass(frozen=True)
class Schedule:
    """The job's length and when each fault comes (job steps, seconds)."""

    steps: int = STEPS
    step_time: float = 0.05
    one_down_at: int = 30
    one_back_at: int = 60
    quorum_lost_at: int = 65
    outage_s: float = OUTAGE_S


#: ``--smoke``: the same faults, early in a short job of short steps.
SMOKE = Schedule(
    steps=150, step_time=0.02, one_down_at=10, one_back_at=20, quorum_lost_at=25, outage_s=2.0
)


def fail(what: str, lines: list[str]) -> SystemExit:
    tail = "\n".join(lines[-40:])
    return SystemExit(f"{what}; last output:\n{tail}")


def wait_for_step(run, step: int, lines: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Wait until the job runs at ``step`` or later; fail loudly after ``STEP_DEADLINE_S``."""
    deadline = time.monotonic() + STEP_DEADLINE_S
    status = None
    while time.monotonic() < deadline:
        status = jobs.read_status(run._client, run.spec.name)
        if status and status.step >= step and status.phase is JobPhase.RUNNING:
            return
        if status and status.phase.terminal:
            raise fail(f"the job ended before it ran at step {step} (status: {status})", lines)
        time.sleep(0.05)
    raise fail(
        f"the job did not run at step {step} within {STEP_DEADLINE_S:g}s (last status: {status})",
        lines,
    )


def pauses(lines: list[str]) -> int:
    return sum(1 for line in lines if PAUSE_LINE in line)


def is_leader(endpoint: str) -> bool:
    """Whether the member at ``endpoint`` is the raft leader (etcd's JSON gateway)."""
    request = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", data=b"{}")
    with urllib.request.urlopen(request, timeout=5) as r:
        status = json.load(r)
    return bool(status["leader"] == status["header"]["member_id"])


def step_times(tmp: Path, steps: int = STEPS) -> tuple[dict[int, float], int, int]:
    """First completion time of each step; steps applied twice by a worker; steps never."""
    first: dict[int, float] = {}
    twice = 0
    for f in (tmp / "steps").glob("*.log"):
        seen = collections.Counter()
        for line in f.read_text().splitlines():
            step, _, _, at = line.split()[:4]
            seen[int(step)] += 1
            first[int(step)] = min(first.get(int(step), float("inf")), float(at))
        twice += sum(1 for c in seen.values() if c > 1)
    never = sum(1 for s in range(steps) if s not in first)
    return first, twice, never


def main() -> None:
    args = parse(argparse.ArgumentParser(description=__doc__.split("\n")[0]), {})
    at = SMOKE if args.smoke else Schedule()
    tmp = Path(tempfile.mkdtemp(prefix="rm-bench-etcd-"))
    lines: list[str] = []
    spec = tiny_job("etcd-outage", tmp, steps=at.steps, step_time=at.step_time)
    with (
        EtcdCluster(3) as cluster,
        quiet_run(spec, lines, etcd=EtcdOptions(cluster.endpoints), timeout=RUN_DEADLINE) as run,
    ):
        wait_for_step(run, at.one_down_at, lines)
        one_down = time.time()
        one_down_from = len(lines)
        leader_killed = is_leader(cluster.members[0].endpoint)
        cluster.kill(0)
        wait_for_step(run, at.one_back_at, lines)
        cluster.restart(0)
        cluster.wait_healthy()
        wait_for_step(run, at.quorum_lost_at, lines)
        one_down_pauses = pauses(lines[one_down_from:])
        quorum_lost = time.time()
        quorum_lost_from = len(lines)
        cluster.kill(0)
        cluster.kill(1)
        time.sleep(at.outage_s)  # the outage itself: etcd is down for this long
        cluster.restart(0)
        cluster.restart(1)
        cluster.wait_healthy()
        healthy = time.time()
        result = run.wait()
        quorum_lost_pauses = pauses(lines[quorum_lost_from:])
    if result.phase is not JobPhase.SUCCEEDED:
        raise fail(f"the job ended {result.phase.value}, not Succeeded", lines)
    first, twice, never = step_times(tmp, at.steps)
    ordered = sorted(first.items())
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(ordered)]
    median = statistics.median(gaps)
    around = [
        b[1] - a[1] for a, b in itertools.pairwise(ordered) if one_down - 2 <= b[1] <= one_down + 5
    ]
    during = [s for s, t in ordered if quorum_lost <= t < healthy]
    after = [t for _, t in ordered if t >= healthy]
    figures = {
        "phase": result.phase.value,
        "median_step_s": round(median, 4),
        "one_member_killed_longest_step_gap_s": round(max(around, default=0.0), 3),
        "one_member_killed_was_leader": leader_killed,
        "one_member_down_pauses": one_down_pauses,
        "quorum_lost_steps_before_pause": len(during),
        "quorum_lost_pauses": quorum_lost_pauses,
        "quorum_outage_s": round(healthy - quorum_lost, 2),
        "resume_after_quorum_back_s": round(after[0] - healthy, 3) if after else None,
        "steps_applied_twice": twice,
        "steps_never_applied": never,
        "recoveries": result.recoveries,
    }
    print(result_line(figures, args.smoke))


if __name__ == "__main__":
    main()
