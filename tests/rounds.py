"""One carrier's round of an outer sync, as the rounds' tests start it."""

from __future__ import annotations

from datetime import timedelta

import torch

from agents.sync.round_exchange import RoundExchange, RoundPlace
from agents.sync.round_media import RoundMedium
from agents.sync.rounds import Offer

#: The round the tests run unless they say otherwise: fragment 1's, started at step 20.
FRAGMENT, AT = 1, 20


def offer_round(
    medium: RoundMedium,
    site: int,
    value: torch.Tensor,
    *,
    sites: int = 2,
    weight: float = 1.0,
    vote: tuple[int, ...] = (0,),
    quorum: int = 2,
    timeout_s: float = 60.0,
    fragment: int = FRAGMENT,
    at: int = AT,
) -> RoundExchange:
    """``site``'s carrier offers ``value`` (one tensor) to the round, in a thread."""
    return RoundExchange(
        medium,
        RoundPlace(fragment=fragment, at=at, site=site, sites=sites),
        [value],
        lambda: [torch.empty_like(value)],
        Offer(weight, vote, parts=0),
        quorum,
        timedelta(seconds=timeout_s),
    )
