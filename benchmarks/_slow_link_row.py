"""The straggler benchmark's slow-link row: one node's NIC limited with ``tc``, found, swapped.

The job of ``benchmarks/_straggler_jobs.py`` with a ``--link-width`` square
layer (512: 1 MB of gradients a step), 2 active nodes and 1 warm spare, run
by the network-namespace harness of the partition test
(:mod:`tests.faults.partitioned_job`): ``node-a`` in a namespace, ``node-b``
and the spare on the host.  At step ``--onset`` both ends of ``node-a``'s veth
are limited to ``--link-rate`` with ``tbf``.  Reported: seconds from the
onset to the ``LinkProbe`` event (the controller suspects a link), to the
``Straggler`` event that names the link, and to the swap; the step rate in
the 10 s before the onset, between the onset and the swap, and from 2 s after
the swap to the end, and after over before; steps lost.  Needs root (``ip
netns``, ``tc``); without it the row says why it was skipped.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks._straggler_jobs import job, rate, step_times
from orchestrator.spec.job import StragglerAction
from orchestrator.state import events, jobs

__all__ = ["link_row"]


def _since(marks: dict[str, float], key: str, onset: float) -> float | None:
    return round(marks[key] - onset, 2) if key in marks else None


def link_row(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The row (see the module docstring)."""
    from tests.faults.netns import IsolatedNode, unavailable_reason
    from tests.faults.partitioned_job import partitioned_job, wait_for

    reason = unavailable_reason()
    if reason is not None:
        print(f"slow link: SKIPPED ({reason})", flush=True)
        return {"skipped": reason}
    tmp = root / "slow-link"
    spec = job(
        "slow-link",
        tmp,
        args,
        nodes=2,
        spares=1,
        action=StragglerAction.SWAP,
        steps=args.steps,
        width=args.link_width,
    )
    spec.fault_tolerance.heartbeat_interval = timedelta(seconds=1)
    marks: dict[str, float] = {}
    lines: list[str] = []
    with IsolatedNode("bench") as node, partitioned_job(spec, node, lines) as running:
        client, name = running.client, spec.name
        try:
            wait_for(
                "the onset step with a warm spare",
                lambda: (
                    (s := jobs.read_status(client, name)) and s.step >= args.onset and s.spare_nodes
                ),
                timeout=300,
            )
        except AssertionError:
            said = "\n".join(lines[-40:])
            print(f"slow link: the job's last output lines:\n{said}", file=sys.stderr)
            raise
        node.limit(args.link_rate, burst="64kb", latency="400ms")
        marks["onset"] = time.time()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "swap" not in marks:
            status = jobs.read_status(client, name)
            if status is not None and status.phase.terminal:
                break  # nothing is called or swapped after the end
            for e in events.list_events(client, name):
                key = {"LinkProbe": "probe", "StragglerSwapped": "swap"}.get(e.type)
                if e.type == "Straggler" and "link is slow" in e.message:
                    key = "call"
                if key is not None and key not in marks:
                    marks[key] = e.time
            time.sleep(0.1)
        status = wait_for(
            "the end of the job",
            lambda: (s := jobs.read_status(client, name)) and s.phase.terminal and s,
            timeout=600,
        )
    done, lost = step_times(tmp)
    onset, end = marks["onset"], max(done.values())
    swap = marks.get("swap", end)
    before = rate(done, onset - 10.0, onset)
    during = rate(done, onset, swap)
    after = rate(done, swap + 2.0, end)
    out: dict[str, Any] = {
        "phase": status.phase.value,
        "rate": args.link_rate,
        "gradient_mb": round(4 * args.link_width * (args.link_width + 1) / 1e6, 2),
        **{f"{k}_s": _since(marks, k, onset) for k in ("probe", "call", "swap")},
        "before_steps_per_s": round(before, 2) if before else None,
        "during_steps_per_s": round(during, 2) if during else None,
        "after_steps_per_s": round(after, 2) if after else None,
        "after_over_before_ratio": round(after / before, 3) if after and before else None,
        "steps_lost": lost,
    }
    print(f"slow link: {out}", flush=True)
    return out
