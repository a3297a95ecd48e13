"""The variables torchrun gives each worker, for one generation of the restart tier
(:mod:`agents.node.restart_tier`): a script written for torchrun reads them
unchanged."""

from __future__ import annotations

from agents.api import ENV_RECOVERY, RECOVERY_RESTART
from orchestrator.state.records import Member, Plan

__all__ = ["ROLE_NAME", "torchrun_env"]

#: torchrun's default role name.
ROLE_NAME = "default"


def torchrun_env(
    *,
    job: str,
    plan: Plan,
    member: Member,
    local_rank: int,
    master: tuple[str, int],
    max_restarts: int,
    error_file: str,
) -> dict[str, str]:
    """The variables torchrun gives a worker, for one generation.

    Ranks follow the plan: ``member``'s workers take ``rank_base + local_rank``;
    ``GROUP_RANK`` is the member's place in the plan.  The restart count is
    the generation's (every new generation restarts every worker), so it is
    the same on every rank, a spare's included.
    """
    rank = member.rank_base + local_rank
    world = plan.world_size
    group_rank = next(i for i, m in enumerate(plan.members) if m.node == member.node)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": ROLE_NAME,
        "ROLE_WORLD_SIZE": str(world),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(member.nproc),
        "GROUP_WORLD_SIZE": str(len(plan.members)),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_RUN_ID": job,
        "TORCHELASTIC_RESTART_COUNT": str(max(plan.generation - 1, 0)),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        ENV_RECOVERY: RECOVERY_RESTART,
    }
