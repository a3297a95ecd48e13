"""Outer syncs by quorum: who takes part in a round, and what the sites agree there (pure).

Runs in the training process; no I/O here (the exchange is
:mod:`agents.sync.round_exchange`).  A *round* is one outer sync of one
fragment, named by the fragment and the step count at which it started
(``at``): each site that reaches it *offers* its pseudo-gradient (its data
first, then the offer that says it is all there) with its weight and what it
votes for.  The round is *decided* once, by whichever site sees first that it
may go ahead (:func:`ready`), in a record that is created only if none exists:
every site, also one that comes later, reads that same record and takes the
same outer step from the same pseudo-gradients.

A round goes ahead when every site of the generation has offered, or when
``quorum`` of them have and ``timeout`` seconds have passed since the first
offer.  A site that offers after the decision is *left out*: its
pseudo-gradient counts for nothing in that round, so it keeps what its inner
steps moved (on top of the new global fragment) and offers it at its next
round (:func:`agents.sync.outer_step.rebase`).

The sites also agree in a round on what must happen at the same step
everywhere (a save, a stop): each offer carries its site's step-boundary
vote (:class:`agents.runtime.boundary.Agreement` as a vector of integers) and
the decision carries their maximum over the sites that take part.  Between
rounds each site votes only inside itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Offer", "RoundDecision", "decide", "maximum", "ready"]


@dataclass(frozen=True)
class Offer:
    """One site's offer to a round (what crosses between sites as JSON).

    Attributes:
        weight: the share its pseudo-gradient counts with: its ranks (its tokens, as
            every rank takes the same batch), 0 for a site that trained nothing of it
            (one that joined after the round started).
        agreement: its site's step-boundary vote, as integers.
        parts: how many stored pieces its pseudo-gradient is cut into.
        source: where the pieces are served (``host:port`` of its carrier's own
            store), or "" where they are in the round's own store.
    """

    weight: float
    agreement: tuple[int, ...]
    parts: int
    source: str = ""

    def encode(self) -> str:
        return json.dumps(
            {
                "weight": self.weight,
                "agreement": list(self.agreement),
                "parts": self.parts,
                "source": self.source,
            }
        )

    @classmethod
    def decode(cls, text: str | bytes) -> Offer:
        raw = json.loads(text)
        return cls(
            float(raw["weight"]),
            tuple(int(v) for v in raw["agreement"]),
            int(raw["parts"]),
            str(raw.get("source", "")),
        )


@dataclass(frozen=True)
class RoundDecision:
    """A decided round: the sites that take part (ascending), their weights and what
    they agreed (where each one's pseudo-gradient is, its carriers' offers say)."""

    sites: tuple[int, ...]
    weights: tuple[float, ...]
    agreement: tuple[int, ...]

    def encode(self) -> str:
        return json.dumps(
            {
                "sites": list(self.sites),
                "weights": list(self.weights),
                "agreement": list(self.agreement),
            }
        )

    @classmethod
    def decode(cls, text: str | bytes) -> RoundDecision:
        raw = json.loads(text)
        return cls(
            tuple(int(s) for s in raw["sites"]),
            tuple(float(w) for w in raw["weights"]),
            tuple(int(v) for v in raw["agreement"]),
        )

    def takes_part(self, site: int) -> bool:
        return site in self.sites

    def read_from(self, site: int) -> bool:
        """``site``'s pseudo-gradient counts in the round (it takes part with a weight
        above 0): the other sites read it."""
        return site in self.sites and self.weights[self.sites.index(site)] > 0

    @property
    def weighed(self) -> bool:
        """Some site that takes part trained its part of the round (its weight is above 0)."""
        return sum(self.weights) > 0


def ready(offered: int, sites: int, quorum: int, waited_s: float, timeout_s: float) -> bool:
    """The round may be decided: every site offered, or ``quorum`` did and ``timeout_s``
    passed since the first offer (``waited_s``)."""
    if offered >= sites:
        return True
    return offered >= min(quorum, sites) and waited_s >= timeout_s


def decide(offers: Mapping[int, Offer]) -> RoundDecision:
    """The decision of a round from the offers present (by site), in site order.

    The agreement is the element-wise maximum of the offers' (the step boundary's
    rule: whatever one site knows, every site acts on).

    Raises:
        ValueError: no offer.
    """
    if not offers:
        raise ValueError("a round is decided from one offer or more")
    sites = tuple(sorted(offers))
    agreement = maximum([offers[s].agreement for s in sites])
    return RoundDecision(
        sites=sites,
        weights=tuple(offers[s].weight for s in sites),
        agreement=agreement,
    )


def maximum(vectors: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The element-wise maximum of votes' integers (a shorter one counts 0 beyond its end)."""
    width = max(len(v) for v in vectors)
    return tuple(max((v[i] for v in vectors if i < len(v)), default=0) for i in range(width))
