"""Outer syncs by quorum: the rounds' rules, and rounds carried through a real torch store.

The carriers here are threads of one process sharing torch's in-process
``HashStore``; the rounds of real jobs (a ``TCPStore`` hosted by a generation's
rank 0, sites in separate processes) are in tests/integration/test_diloco_rounds.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from agents.sync.outer_step import flatten, rebase
from agents.sync.round_exchange import PIECE_BYTES, RoundExchange, RoundPlace, _to_bytes
from agents.sync.round_media import STORE_PREFIX, RoundsInStore
from agents.sync.rounds import Offer, RoundDecision, decide, maximum, ready
from tests.rounds import offer_round

pytestmark = pytest.mark.unit

NEVER: Callable[[], bool] = lambda: False  # noqa: E731


def test_a_round_goes_ahead_with_every_site_or_with_a_quorum_after_the_timeout() -> None:
    assert ready(offered=3, sites=3, quorum=3, waited_s=0.0, timeout_s=60.0)
    assert not ready(offered=2, sites=3, quorum=2, waited_s=59.0, timeout_s=60.0)
    assert ready(offered=2, sites=3, quorum=2, waited_s=60.0, timeout_s=60.0)
    assert not ready(offered=1, sites=3, quorum=2, waited_s=600.0, timeout_s=60.0)
    # a quorum above the sites there are: every site is the most there can be
    assert ready(offered=2, sites=2, quorum=5, waited_s=0.0, timeout_s=60.0)


def test_a_decision_takes_the_offers_in_site_order_and_the_maximum_of_their_votes() -> None:
    offers = {2: Offer(2.0, (1, 7, -3), 1), 0: Offer(1.0, (4, 0, -5), 3, "10.0.0.1:4000")}
    decision = decide(offers)
    assert decision.sites == (0, 2) and decision.weights == (1.0, 2.0)
    assert decision.agreement == (4, 7, -3)
    assert RoundDecision.decode(decision.encode()) == decision
    assert Offer.decode(offers[0].encode()) == offers[0]
    assert decision.takes_part(2) and not decision.takes_part(1)
    assert decision.read_from(2) and not decision.read_from(1)
    assert not RoundDecision((0, 1), (1.0, 0.0), ()).read_from(1)  # in it, trained nothing
    assert maximum([(1, 2), (3,)]) == (3, 2)
    with pytest.raises(ValueError):
        decide({})


def _place(site: int, sites: int = 2) -> RoundPlace:
    return RoundPlace(fragment=1, at=20, site=site, sites=sites)


def _offer(store: dist.Store, site: int, value: torch.Tensor, **kw: Any) -> RoundExchange:
    return offer_round(RoundsInStore(lambda: store), site, value, **kw)


def test_two_sites_receive_each_others_pseudo_gradients_and_clean_up() -> None:
    store = dist.HashStore()
    a = _offer(store, 0, torch.full((5,), 1.0), weight=2.0, vote=(1, 0))
    b = _offer(store, 1, torch.full((5,), 3.0), weight=1.0, vote=(0, 4))
    got_a, got_b = a.wait(NEVER, 30.0), b.wait(NEVER, 30.0)
    assert got_a.decision == got_b.decision
    assert got_a.decision.sites == (0, 1) and got_a.decision.agreement == (1, 4)
    for got in (got_a, got_b):
        weights = [w for w, _ in got.received]
        values = [float(p[0][0]) for _, p in got.received]
        assert weights == [2.0, 1.0] and values == [1.0, 3.0]  # in site order
    assert got_a.bytes_read == got_b.bytes_read == 5 * 4  # only the other site's
    prefix = STORE_PREFIX + _place(0).name
    assert store.check([prefix + "offer/0/0", prefix + "offer/1/0"])  # the offers stay
    assert not store.check([prefix + "data/0/0/0"]) and not store.check([prefix + "data/1/0/0"])


def test_a_site_that_comes_after_the_quorum_went_ahead_is_left_out_but_takes_the_step() -> None:
    """Quorum 1: site 0 waits 0.05 s for site 1, then goes ahead alone.  Site 1 offers
    afterwards: it reads the same decision (it is not in it) and site 0's
    pseudo-gradient, so it takes the same outer step."""
    store = dist.HashStore()
    early = _offer(store, 0, torch.full((4,), 2.0), quorum=1, timeout_s=0.05)
    first = early.wait(NEVER, 30.0)
    assert first.decision.sites == (0,)
    late = _offer(store, 1, torch.full((4,), 9.0), quorum=1, timeout_s=0.05)
    second = late.wait(NEVER, 30.0)
    assert second.decision == first.decision and not second.decision.takes_part(1)
    assert [float(p[0][0]) for _, p in second.received] == [2.0]


def test_a_pseudo_gradient_larger_than_a_stored_value_travels_in_pieces() -> None:
    store = dist.HashStore()
    big = torch.arange(PIECE_BYTES // 4 + 1000, dtype=torch.float32)  # 2 pieces
    a, b = _offer(store, 0, big), _offer(store, 1, -big)
    got = a.wait(NEVER, 60.0)
    b.wait(NEVER, 60.0)
    offer = Offer.decode(store.get(STORE_PREFIX + _place(0).name + "offer/0/0"))
    assert offer.parts == 2
    assert torch.equal(got.received[1][1][0], -big)


def test_a_round_without_its_quorum_gives_up_when_the_generation_moves_on() -> None:
    store = dist.HashStore()
    alone = _offer(store, 0, torch.ones(3))  # quorum 2: site 1 never comes
    with pytest.raises(RuntimeError, match="newer generation"):
        alone.wait(lambda: True, 30.0)
    alone = RoundExchange(
        RoundsInStore(lambda: store),
        RoundPlace(fragment=0, at=40, site=0, sites=2),
        [torch.ones(3)],
        lambda: [torch.empty(3)],
        Offer(1.0, (), 0),
        2,
        timedelta(0),
    )
    with pytest.raises(RuntimeError, match="timed out"):
        alone.wait(NEVER, 0.2)


class _BeatenToIt:
    """A medium whose carrier loses the race to decide: just before its own decision, a
    third site offers and another carrier decides with it (from a later look)."""

    def __init__(self, store: dist.Store) -> None:
        self.inner = RoundsInStore(lambda: store)
        self.store = store

    def open(self, place: RoundPlace, stop: object) -> object:
        link = self.inner.open(place, stop)  # type: ignore[arg-type]
        decide = link.decide

        def beaten(mine: RoundDecision) -> RoundDecision:
            third = self.inner.open(dataclasses.replace(place, site=2), stop)  # type: ignore[arg-type]
            parts, _ = third.put(_to_bytes([torch.full((3,), 7.0)]))
            third.offer(Offer(1.0, (5,), parts))
            decide(RoundDecision((0, 2), (1.0, 1.0), (5,)))
            return decide(mine)

        link.decide = beaten  # type: ignore[method-assign]
        return link


def test_a_carrier_that_loses_the_decision_reads_the_sites_it_did_not_see() -> None:
    store = dist.HashStore()
    medium = _BeatenToIt(store)
    a = RoundExchange(
        medium,  # type: ignore[arg-type]
        RoundPlace(fragment=1, at=20, site=0, sites=3),
        [torch.full((3,), 1.0)],
        lambda: [torch.empty(3)],
        Offer(1.0, (0,), 0),
        quorum=1,
        timeout=timedelta(0),
    )
    got = a.wait(NEVER, 30.0)
    assert got.decision.sites == (0, 2) and got.decision.agreement == (5,)
    assert [float(p[0][0]) for _, p in got.received] == [1.0, 7.0]


def test_a_site_left_out_keeps_its_own_steps_on_the_new_anchor() -> None:
    params = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    old, new = torch.tensor([0.5, 2.5, 3.0]), torch.tensor([10.0, 20.0, 30.0])
    rebase(params, old, new)
    assert torch.equal(flatten(params), torch.tensor([10.5, 19.5, 30.0]))
