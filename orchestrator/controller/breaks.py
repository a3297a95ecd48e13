"""Who failed when a generation broke: pure rules over break reports and liveness answers.

When workers report that their generation broke, the policy
(:mod:`orchestrator.controller.policy`) asks :func:`judge_break` whom to
replace, or whether to wait: a silent member whose agent refused a liveness
probe (or one of whose workers was killed for a hang) is gone at once; one
whose agent answered is late, not gone, and keeps its place; the others get
:data:`REPORT_GRACE` to report.  In the restart tier, :func:`reports_pending`
gives silent members the same grace first, so that :func:`culprit`, the
earliest report of an error in the script, names the script's own error
rather than a peer's broken collective.  Runs in the controller.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from datetime import timedelta

from orchestrator.controller.world import World, silent_members
from orchestrator.state.records import BreakReport, Plan

__all__ = [
    "REPORT_GRACE",
    "Verdict",
    "consequences",
    "culprit",
    "failure_reason",
    "gone_unreported",
    "judge_break",
    "reports_pending",
]

#: After the first failure report, how long to wait for the other survivors' reports.
REPORT_GRACE = timedelta(seconds=1.0)


@dataclass(frozen=True)
class Verdict:
    """The members of a broken generation to replace, and why in words."""

    failed: set[str]
    why: str
    #: those of ``failed`` whose agent refused a liveness probe or whose watch closed
    agent_gone: set[str]
    #: when the failure was seen (wall clock), where that was before the tick deciding it
    seen_at: float | None = None


def judge_break(
    plan: Plan, world: World, hung: Set[str], seen_at: float, in_grace: bool
) -> Verdict | None:
    """Whom to replace in ``plan``, broken since ``seen_at`` (monotonic); None: wait.

    Args:
        hung: members one of whose workers was killed for a hang (they cannot report).
        in_grace: after an etcd outage: reports and registrations are still coming back.
    """
    silent = silent_members(plan, world.reports)
    gone = world.agents_gone
    # a refused liveness probe (or a watch closed unannounced) is first-hand: it needs
    # no grace, not even after an outage; nor does a node whose worker was killed for a
    # hang (it cannot report)
    known = (gone | hung) & silent
    # a silent member whose agent answered a probe is late, not gone: at a thousand
    # nodes the survivors' reports take a while to land, and waiting for them, or
    # replacing the late ones, would make one failure cost many
    late = (world.alive & silent) - known
    waiting = silent - known - late
    # no wait once every silent member is accounted for and one of them is gone
    if (waiting or (late and not known)) and (
        world.mono - seen_at < REPORT_GRACE.total_seconds() or in_grace
    ):
        return None  # give the other survivors time to report
    if all(r.planned for r in world.reports.values()) and not silent:
        return None  # a planned switch: the new generation is already published
    # whoever neither answered nor reported; if every silent member's agent
    # answers (a worker of theirs died, not the node), those members
    # with every member reported: those whose agent went since (else nobody)
    failed = (silent - late) or silent or (gone & {m.node for m in plan.members})
    why = failure_reason(failed, world.dead, hung, set(world.closed))
    return Verdict(failed, why, gone & failed)


def gone_unreported(plan: Plan, world: World, in_grace: bool) -> Verdict | None:
    """Members gone with no break reported: a watch closed unannounced (first-hand:
    even in an outage's grace), or (after that grace) their registration expired."""
    members = {m.node for m in plan.members}
    if closed := world.closed.keys() & members:
        why = failure_reason(closed, world.dead, set(), closed)
        return Verdict(closed, why, closed, min(world.closed[n] for n in closed))
    if in_grace:
        return None  # registrations are still coming back
    if expired := {n for n in members if n not in world.nodes}:
        return Verdict(expired, f"lease expired: {', '.join(sorted(expired))}", set())
    return None


def reports_pending(plan: Plan, world: World, first_report_at: float) -> bool:
    """Restart tier: silent members, not known dead, still within ``REPORT_GRACE``.

    Their reports tell whose failure came first (the script's own error, or
    the collective it broke on the peers).
    """
    waiting = silent_members(plan, world.reports) - world.agents_gone
    return bool(waiting) and world.mono - first_report_at < REPORT_GRACE.total_seconds()


def culprit(reports: dict[str, BreakReport]) -> tuple[str, BreakReport]:
    """The earliest report of an error in the script: the peers' collectives broke after it."""
    return min(
        ((x, r) for x, r in reports.items() if r.user_error),
        key=lambda item: (item[1].at, item[0]),
    )


def failure_reason(
    failed: Set[str], dead: Set[str], hung: Set[str], closed: Set[str] = frozenset()
) -> str:
    """Why ``failed`` are replaced, in the words of the failure event."""
    if not failed:
        return "every member reported the break and none is gone (a collective failed or timed out)"
    names = ", ".join(sorted(failed))
    if failed <= closed:
        return f"agent of {names} gone (its liveness watch closed)"
    if failed <= dead | closed:
        return f"agent of {names} gone (liveness port refused)"
    if hung and failed <= set(hung) | dead:
        return f"a worker of {names} hung and was killed"
    return f"no report from {names}"


def consequences(why: str, reports: dict[str, BreakReport], failed: Set[str]) -> str:
    """Restart tier: ``" (<why>); the errors reported by a, b followed from it"``, or "".

    The survivors' workers died on the collectives the failed members left:
    their errors (gloo's ``Connection reset by peer``) are a consequence, and
    the phase's message says so rather than quote them as the cause.
    """
    reporters = sorted({worker.rsplit("-", 1)[0] for worker in reports} - set(failed))
    if not reporters:
        return ""
    return f" ({why}); the errors reported by {', '.join(reporters)} followed from it"
