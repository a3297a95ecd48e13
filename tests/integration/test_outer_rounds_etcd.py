"""Rounds of outer syncs kept in a real etcd, each carrier's bytes served by its own store.

Each site's carrier is a thread here with a :class:`PieceServer` of its own
(a real ``TCPStore`` listening on 127.0.0.1): the records go through a real
etcd, the pseudo-gradients from one carrier's server to the others'
connections.  No generation store takes part.  Real jobs whose rounds go this
way are in tests/integration/test_diloco_rounds.py and test_diloco.py.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from agents.sync.round_etcd import PieceServer, RoundsInEtcd
from agents.sync.round_exchange import PIECE_BYTES, RoundExchange, RoundResult
from agents.sync.rounds import Offer, RoundDecision
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.state import keys
from tests.rounds import AT, FRAGMENT, offer_round

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NEVER: Callable[[], bool] = lambda: False  # noqa: E731


def _served(server: PieceServer, generation: int, part: int = 0) -> bool:
    """Whether ``server`` still holds a piece of the test's round (asked over TCP)."""
    host, _, port = server.address.rpartition(":")
    reader = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    return reader.check([f"g{generation}/f{FRAGMENT}/a{AT}/{part}"])


def _job() -> str:
    return f"rounds-{uuid.uuid4().hex[:8]}"


def test_three_sites_read_each_other_from_their_own_stores_and_decide_in_etcd(
    etcd_client: EtcdClient,
) -> None:
    job, gen = _job(), 5
    servers = [PieceServer("127.0.0.1") for _ in range(3)]
    media = [RoundsInEtcd(etcd_client, job, gen, s) for s in servers]
    values = [torch.full((6,), float(v)) for v in (1, 2, 3)]
    rounds = [
        offer_round(m, i, v, sites=3, weight=i + 1.0, vote=(i, -i))
        for i, (m, v) in enumerate(zip(media, values, strict=True))
    ]
    got = [r.wait(NEVER, 60.0) for r in rounds]

    prefix = keys.outer_round(job, gen, FRAGMENT, AT)
    stored = {kv.key[len(prefix) :]: kv.value for kv in etcd_client.get_prefix(prefix)}
    assert set(stored) == {"decision", "offer/0/0", "offer/1/0", "offer/2/0"}
    decision = RoundDecision.decode(stored["decision"])
    assert all(g.decision == decision for g in got)
    assert decision.sites == (0, 1, 2) and decision.weights == (1.0, 2.0, 3.0)
    assert decision.agreement == (2, 0)
    for site, server in enumerate(servers):  # each offer names its own carrier's server
        assert Offer.decode(stored[f"offer/{site}/0"]).source == server.address
    for g in got:
        assert [float(p[0][0]) for _, p in g.received] == [1.0, 2.0, 3.0]
        assert g.bytes_read == 2 * 6 * 4  # the two other sites', from their servers
    for server in servers:  # the last of the two other readers deleted each one's pieces
        assert not _served(server, gen)


def test_a_late_site_reads_the_decision_and_the_early_site_from_its_server(
    etcd_client: EtcdClient,
) -> None:
    job, gen = _job(), 2
    early_server, late_server = PieceServer("127.0.0.1"), PieceServer("127.0.0.1")
    early = offer_round(
        RoundsInEtcd(etcd_client, job, gen, early_server),
        0,
        torch.full((4,), 2.0),
        quorum=1,
        timeout_s=0.05,
    )
    first = early.wait(NEVER, 30.0)
    assert first.decision.sites == (0,)
    assert _served(early_server, gen), "the late site has not read it yet"
    late = offer_round(
        RoundsInEtcd(etcd_client, job, gen, late_server),
        1,
        torch.full((4,), 9.0),
        quorum=1,
        timeout_s=0.05,
    )
    second = late.wait(NEVER, 30.0)
    assert second.decision == first.decision and not second.decision.takes_part(1)
    assert [float(p[0][0]) for _, p in second.received] == [2.0]
    assert not _served(early_server, gen), "read by every other site: deleted"
    assert not _served(late_server, gen), "left out: nobody reads it, its carrier dropped it"


def test_a_pseudo_gradient_larger_than_a_stored_value_travels_in_pieces(
    etcd_client: EtcdClient,
) -> None:
    job, gen = _job(), 1
    big = torch.arange(PIECE_BYTES // 4 + 1000, dtype=torch.float32)  # 2 pieces
    servers = [PieceServer("127.0.0.1"), PieceServer("127.0.0.1")]
    a, b = (
        offer_round(RoundsInEtcd(etcd_client, job, gen, s), i, v)
        for i, (s, v) in enumerate(zip(servers, (big, -big), strict=True))
    )
    got = a.wait(NEVER, 60.0)
    b.wait(NEVER, 60.0)
    offer = etcd_client.get(keys.outer_round(job, gen, FRAGMENT, AT) + "offer/1/0")
    assert offer is not None and Offer.decode(offer.value).parts == 2
    assert torch.equal(got.received[1][1][0], -big)
    assert not any(_served(s, gen, part) for s in servers for part in (0, 1))


def test_a_new_generation_prunes_the_older_rounds_and_their_pieces(
    etcd_client: EtcdClient,
) -> None:
    job = _job()
    server = PieceServer("127.0.0.1")
    alone = offer_round(RoundsInEtcd(etcd_client, job, 3, server), 0, torch.ones(3), quorum=2)
    with pytest.raises(RuntimeError, match="newer generation"):
        alone.wait(lambda: True, 30.0)  # generation 3's round never completes
    assert etcd_client.get_prefix(keys.outer_rounds(job, 3))
    assert _served(server, 3)
    etcd_client.put(keys.outer_round(job, 9, 0, 0) + "offer/0/0", "a later generation's")

    again = offer_round(
        RoundsInEtcd(etcd_client, job, 4, server), 0, torch.ones(3), quorum=1, timeout_s=0
    )
    again.wait(NEVER, 30.0)
    assert not etcd_client.get_prefix(keys.outer_rounds(job, 3)), "site 0 pruned generation 3"
    assert etcd_client.get_prefix(keys.outer_rounds(job, 9)), "a newer one is left alone"
    assert not _served(server, 3), "generation 3's pieces went with the next round it kept"
    assert server.serving() == [f"g4/f{FRAGMENT}/a{AT}/"]


def test_a_round_every_site_came_to_prunes_the_fragments_earlier_rounds(
    etcd_client: EtcdClient,
) -> None:
    """Rounds of fragment 1 at steps 20, 30 (site 1 late: decided by a quorum of 1) and
    40: the records of 20 stay until a round that every site came to (40) shows that
    every site is past them; fragment 2's round is not touched."""
    job, gen = _job(), 7
    media = [RoundsInEtcd(etcd_client, job, gen, PieceServer("127.0.0.1")) for _ in range(2)]

    def both(at: int, fragment: int = 1, late: bool = False) -> None:
        def one(site: int, quorum: int, timeout_s: float) -> RoundExchange:
            value = torch.ones(2)
            return offer_round(
                media[site],
                site,
                value,
                fragment=fragment,
                at=at,
                quorum=quorum,
                timeout_s=timeout_s,
            )

        if late:  # site 0 goes ahead alone, site 1 comes after the decision
            one(0, 1, 0.0).wait(NEVER, 30.0)
            one(1, 1, 0.0).wait(NEVER, 30.0)
        else:
            a, b = (one(s, 2, 60.0) for s in (0, 1))
            a.wait(NEVER, 30.0)
            b.wait(NEVER, 30.0)

    def rounds() -> set[str]:
        root = keys.outer_rounds(job, gen)
        return {"/".join(kv.key[len(root) :].split("/")[:2]) for kv in etcd_client.get_prefix(root)}

    both(20)
    both(5, fragment=2)
    both(30, late=True)
    assert rounds() == {"f1/a20", "f2/a5", "f1/a30"}, "a quorum's round prunes nothing"
    both(40)
    assert rounds() == {"f2/a5", "f1/a40"}


def _wait_into(round_: RoundExchange, limit_s: float, out: list) -> None:  # type: ignore[type-arg]
    try:
        out.append(round_.wait(NEVER, limit_s))
    except BaseException as e:  # the test reads it
        out.append(e)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "etcd unavailable" in record.getMessage():
            self.seen.set()


def test_a_round_waits_out_an_etcd_outage(
    private_etcd: tuple[EmbeddedEtcd, EtcdClient],
) -> None:
    server_etcd, _ = private_etcd
    client = connect(EtcdOptions((server_etcd.endpoint,), op_timeout=timedelta(seconds=0.5)))
    pid = server_etcd.pid
    assert pid is not None
    warnings = _Warnings()
    logging.getLogger().addHandler(warnings)
    try:
        job, gen = _job(), 1
        servers = [PieceServer("127.0.0.1"), PieceServer("127.0.0.1")]
        waited: list[RoundResult | BaseException] = []
        os.kill(pid, signal.SIGSTOP)  # etcd stops answering: the round's calls time out
        try:
            a = offer_round(RoundsInEtcd(client, job, gen, servers[0]), 0, torch.ones(2))
            waiting = threading.Thread(target=_wait_into, args=(a, 1.0, waited))
            waiting.start()  # a wait limit of 1 s, shorter than the outage
            assert warnings.seen.wait(30), "the round never met the outage"
            threading.Event().wait(2.5)  # the outage lasts past the round's wait limit
        finally:
            os.kill(pid, signal.SIGCONT)
        b = offer_round(RoundsInEtcd(client, job, gen, servers[1]), 1, torch.full((2,), 3.0))
        waiting.join(60)
        assert len(waited) == 1 and isinstance(waited[0], RoundResult), waited
        got = waited[0]
        assert (
            b.wait(NEVER, 60.0).decision == got.decision == RoundDecision((0, 1), (1.0, 1.0), (0,))
        )
        assert [float(p[0][0]) for _, p in got.received] == [1.0, 3.0]
    finally:
        logging.getLogger().removeHandler(warnings)
        client.close()
