"""Recoveries as records: why a generation broke and where the time went.

A recovery runs from the failure to the first completed step of the
generation that replaced the broken one.  It is split into four phases whose
boundaries come from the controller and from every worker's telemetry
(:mod:`agents.runtime.telemetry`)::

    failure ─detect─► declared ─rendezvous─► formed ─restore─► restored ─first step─► trained

* failure: the earliest sign of it (a survivor's report of a failed
  collective; for a hang, when the worker stopped making steps);
* declared: the controller published the generation that replaces it;
* group formed / restored / trained: the last worker of the new generation
  to reach that point.

Each boundary is clamped to be no earlier than the one before, so the phases
are never negative and always add up to the total.

A replacement that found no warm spare (one still starting, or none yet)
waits for one before the controller declares it: that wait ends the *detect*
phase, but it is not detection.  The record keeps it (``spare_wait_s``, at
most the detect phase) and :func:`recovered_message` shows it apart:
``detect 3.40s (of which 3.10s waiting for a spare)``.  The phases are
unchanged by it and still add up to the total, and the whole recovery is still
time lost to failures (:mod:`orchestrator.observe.training_time`).

In the restart tier the scripts report no steps: the boundaries are the
agents' (:func:`recovered_message` words them): *declared*, then *relaunched*
(the last agent started the new workers: the group-formed boundary), then the
script's next progress, its first line of output (the restored and trained
boundaries), when the agents report it.  Also here: the failure
causes.  What the recoveries cost the run beside its start-up and its
checkpoint stalls is :mod:`orchestrator.observe.training_time`.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

from orchestrator.observe.records import PHASES, RecoveryRecord
from orchestrator.state.records import Event

#: Workers kept in a recovery's record per phase boundary: the last ones to reach
#: it (they set the phase).  Every other worker is only counted, so the record
#: stays a few KiB at thousands of workers (one entry each was 2.7 MB at 1,000 x 8,
#: over etcd's request limit).
SLOWEST_KEPT = 3

#: The workers' telemetry times that bound the phases after the declaration.
_BOUNDARIES = ("group_formed_at", "restored_at", "first_step_at")


class FailureCause(str, Enum):
    """Why a node left the job, as far as the control plane can tell."""

    EXIT_CODE = "exit_code"  # a worker exited with a non-zero code
    SIGNAL = "signal"  # a worker was killed by a signal
    HANG = "hang"  # its heartbeats stopped (3 intervals, then watched one more)
    LEASE_EXPIRY = "lease_expiry"  # the node's registration lease ran out (or was revoked)
    PREEMPTION = "preemption"  # the node got SIGTERM (spot reclaim, drain)
    AGENT_GONE = "agent_gone"  # the agent's liveness port refused: killed or crashed
    UNRESPONSIVE = "unresponsive"  # its peers' collectives failed and it never reported


def classify_cause(
    nodes: Iterable[str],
    events: Iterable[Event],
    registered: Iterable[str],
    agent_gone: Iterable[str] = (),
) -> FailureCause:
    """The most specific cause the event log and the registrations show for ``nodes``.

    Args:
        nodes: the nodes declared failed.
        events: recent events (around the failure).
        registered: nodes whose registration lease is still alive.
        agent_gone: nodes whose agent's liveness port refused the connection.
    """
    failed = set(nodes)
    found: set[FailureCause] = set()
    for ev in events:
        node = str(ev.data.get("node") or ev.source)
        worker = str(ev.data.get("worker", ""))
        mine = node in failed or any(worker.startswith(f"{n}-") for n in failed)
        if not mine:
            continue
        if ev.type == "WorkerHung":
            found.add(FailureCause.HANG)
        elif ev.type == "Preempted":
            found.add(FailureCause.PREEMPTION)
        elif ev.type == "WorkerExited":
            code = int(ev.data.get("exit_code", 1))
            found.add(FailureCause.SIGNAL if code < 0 else FailureCause.EXIT_CODE)
    if failed & set(agent_gone):
        found.add(FailureCause.AGENT_GONE)
    if failed - set(registered):
        found.add(FailureCause.LEASE_EXPIRY)
    for cause in (
        FailureCause.HANG,
        FailureCause.PREEMPTION,
        FailureCause.SIGNAL,
        FailureCause.EXIT_CODE,
        FailureCause.AGENT_GONE,
        FailureCause.LEASE_EXPIRY,
    ):
        if cause in found:
            return cause
    return FailureCause.UNRESPONSIVE


def ordered_phases(phases: dict[str, Any]) -> dict[str, float]:
    """A recovery's phases in the order they happen.

    A stored record's ``phases`` come back in key order (alphabetical); this
    puts them in the order of :data:`~orchestrator.observe.records.PHASES` (detect,
    rendezvous, restore, first step), names unknown to this release last.
    """
    names = [n for n in PHASES if n in phases] + [n for n in phases if n not in PHASES]
    return {name: float(phases[name]) for name in names}


def phase_label(name: str) -> str:
    """A phase's name for people: ``first_step`` is ``first step``."""
    return name.replace("_", " ")


def build_record(
    *,
    generation: int,
    cause: str,
    nodes: list[str],
    reason: str,
    failure_at: float,
    declared_at: float,
    workers: dict[str, dict[str, Any]],
    step: int,
    observed_s: float,
    spare_wait_s: float = 0.0,
) -> RecoveryRecord:
    """A record from the controller's times and the new generation's worker telemetry.

    The phases come from every worker; the record keeps the telemetry of only
    the :data:`SLOWEST_KEPT` last workers to reach each boundary, and counts
    and summaries (sources, steps lost, what ended the step) of all of them.

    Args:
        workers: worker id → its telemetry (``agents.runtime.telemetry``) for ``generation``.
        spare_wait_s: seconds of the time to the declaration spent waiting for a
            spare (kept apart from detection; at most that time).
    """

    def last(name: str, floor: float) -> float:
        values = [float(t[name]) for t in workers.values() if t.get(name) is not None]
        return max([floor, *values])

    declared = max(declared_at, failure_at)
    formed = last("group_formed_at", declared)
    restored = last("restored_at", formed)
    first = last("first_step_at", restored)
    restored_steps = [
        int(t["restored_step"]) for t in workers.values() if t.get("restored_step") is not None
    ]
    return RecoveryRecord(
        generation=generation,
        cause=cause,
        nodes=sorted(nodes),
        reason=reason,
        failure_at=failure_at,
        declared_at=declared,
        group_formed_at=formed,
        restored_at=restored,
        first_step_at=first,
        step=step,
        restored_step=min(restored_steps) if restored_steps else step,
        observed_s=round(observed_s, 6),
        workers={w: dict(workers[w]) for w in sorted(_slowest(workers))},
        ended_by="+".join(
            sorted({str(t["left_by"]) for t in workers.values() if t.get("left_by")})
        ),
        worker_count=len(workers),
        restored_from="+".join(
            sorted({str(t["restored_from"]) for t in workers.values() if t.get("restored_from")})
        ),
        most_steps_lost=max([int(t.get("steps_lost") or 0) for t in workers.values()] or [0]),
        spare_wait_s=round(min(max(spare_wait_s, 0.0), declared - failure_at), 6),
    )


def recovered_message(record: RecoveryRecord, restart_tier: bool) -> str:
    """The ``Recovered`` event's message.

    In the restart tier it names what was measured: the relaunch, and the
    script's next progress (its first line of output) when the agents
    reported it, rather than steps the script never reported.
    """
    phases = record.phases
    detect = detect_text(record)
    if not restart_tier:
        return (
            f"generation {record.generation} trains again {record.total_s:.2f}s after the "
            f"failure ({record.cause}): {detect}, rendezvous "
            f"{phases['rendezvous']:.2f}s, restore {phases['restore']:.2f}s, first step "
            f"{phases['first_step']:.2f}s"
        )
    relaunch = phases["detect"] + phases["rendezvous"]
    progress = phases["restore"] + phases["first_step"]
    timings = f"{detect}, relaunch {phases['rendezvous']:.2f}s"
    if record.first_step_at <= record.group_formed_at:  # the agents reported no output
        return (
            f"generation {record.generation}: every worker relaunched {relaunch:.2f}s after "
            f"the failure ({record.cause}): {timings}; the script's next progress was not "
            "reported (its steps are its own)"
        )
    return (
        f"generation {record.generation}: the script made progress again (its first line "
        f"of output) {record.total_s:.2f}s after the failure ({record.cause}): {timings}, "
        f"to the first output {progress:.2f}s"
    )


def detect_text(record: RecoveryRecord) -> str:
    """The detect phase for people, with the part of it spent waiting for a spare."""
    text = f"detect {record.phases['detect']:.2f}s"
    if record.spare_wait_s > 0:
        text += f" (of which {record.spare_wait_s:.2f}s waiting for a spare)"
    return text


def restart_phases(phases: dict[str, Any]) -> dict[str, float]:
    """A restart-tier recovery's phases under the names of what they measured:
    detect, relaunch, and the script's first output (absent when not reported)."""
    out = {"detect": float(phases.get("detect", 0.0))}
    out["relaunch"] = float(phases.get("rendezvous", 0.0))
    progress = float(phases.get("restore", 0.0)) + float(phases.get("first_step", 0.0))
    if progress > 0:
        out["to first output"] = progress
    return out


def _slowest(workers: dict[str, dict[str, Any]]) -> set[str]:
    """The :data:`SLOWEST_KEPT` workers that reached each boundary last."""
    kept: set[str] = set()
    for name in _BOUNDARIES:
        timed = [(float(t[name]), w) for w, t in workers.items() if t.get(name) is not None]
        kept.update(w for _, w in sorted(timed, reverse=True)[:SLOWEST_KEPT])
    return kept
