"""What the controller's policy remembers between ticks (:mod:`orchestrator.controller.policy`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.api import JobPhase
from orchestrator.controller.hangs import HangWatch

__all__ = ["Memory"]


@dataclass
class Memory:
    """What the policy remembers between ticks (monotonic times unless said otherwise)."""

    min_reached_at: float | None = None
    #: generation whose break is being handled, and when its first report was seen
    break_generation: int | None = None
    break_seen_at: float = 0.0
    recovery_started: float | None = None
    recovery_step: int = 0
    #: fewer than nodes.min nodes left since then
    short_since: float | None = None
    #: silent workers watched, and those told to die for a hang (each told once)
    hangs: HangWatch = field(default_factory=HangWatch)
    #: the generation, and its members one of whose workers was killed for a hang:
    #: they will not report the break, so nobody waits for them
    hung: tuple[int, frozenset[str]] = (0, frozenset())
    grace_until: float = 0.0
    paused_from: JobPhase | None = None
    silence_seen: tuple[float, float] | None = None
    #: generations that ended with an error of the training script
    user_errors: list[int] = field(default_factory=list)
    #: restart tier: the generation whose first break report was seen, and when
    reported: tuple[int, float] | None = None
    #: the model is sharded in each site (a worker reported sites of different sizes):
    #: every plan from then on keeps the sites of one size
    equal_sites: bool = False
    #: nodes a plan replaced or dropped, with the time of their registration then
    #: (``NodeRecord.started``; None: not registered): a node rejoins a generation by a
    #: scale-up only with a registration written since (its agent started again, or
    #: re-registered a restarted worker); not kept across a change of leader
    dropped: dict[str, float | None] = field(default_factory=dict)
