"""Rounds of outer syncs kept in etcd, each carrier's bytes served by a store of its own.

Runs in the training process, in a round's thread (the contract is
:mod:`agents.sync.round_media`'s).  The records go into etcd, under the
generation's key (``/ringmaster/jobs/<job>/pg/<gen>/outer/f<f>/a<at>/``), the
decision created only where none exists (a transaction); each carrier serves
its own pseudo-gradients from a ``TCPStore`` of its own (:class:`PieceServer`,
its address in its offer), so a round's bytes go from the site that made them
straight to the site that reads them, and no round lives in a store that
another site hosts.  An etcd outage pauses a round: the time etcd is away is
not counted against the round's wait limit (:meth:`RoundLink.outage_s`).
What is no longer read goes: a pseudo-gradient once every other site read
it, a fragment's earlier rounds once every site came to a later one, older
generations' rounds at the first round of a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch.distributed as dist

from agents.sync.round_media import (
    STORE_TIMEOUT,
    RoundLink,
    RoundPlace,
    cut,
    pieces,
    read_pieces,
)
from agents.sync.rounds import Offer, RoundDecision
from orchestrator.api import EtcdError, EtcdUnavailableError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.state import keys

__all__ = ["READ_COUNT", "PieceServer", "RoundsInEtcd"]

T = TypeVar("T")

log = logging.getLogger("ringmaster.worker")

#: The key, after a round's prefix on a carrier's store, that counts its readers.
READ_COUNT = "read"


@dataclass
class PieceServer:
    """This process's store of its own pseudo-gradients, read by the other sites.

    A ``TCPStore`` listening on a port the system picks (on every interface;
    ``host`` is the address the other sites reach this node at), started by
    :meth:`start` (a session under a delayed sync starts it before any group
    forms) or else at the first :meth:`keep`, and kept for the life of the
    process.  A round's
    pieces go once the other sites have read them (their last reader deletes
    them), once this carrier finds nobody will (it is left out of the round),
    or at the first round of a later generation.
    """

    host: str
    _store: dist.TCPStore | None = None
    _kept: dict[str, tuple[int, int]] = field(default_factory=dict)  # prefix -> gen, parts
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        store = self._serving()
        return f"{self.host}:{store.port}"

    def start(self) -> None:
        """Listen now (it would at the first :meth:`keep`)."""
        self._serving()

    def forget_before(self, generation: int) -> None:
        """Drop what generations older than ``generation`` left (a new one was joined)."""
        with self._lock:
            store = self._store
            if store is None:
                return
            for p, (g, n) in list(self._kept.items()):
                if g < generation:
                    self._drop_locked(store, p, n)

    def _serving(self) -> dist.TCPStore:
        with self._lock:
            if self._store is None:
                self._store = dist.TCPStore(
                    self.host, 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT
                )
            return self._store

    def keep(self, generation: int, prefix: str, blob: bytes) -> int:
        """Serve ``blob`` under ``prefix`` (in pieces ``prefix0``, ``prefix1``…); drops
        what older generations left.  Returns the number of pieces."""
        store = self._serving()
        with self._lock:
            gone = [
                (p, n)
                for p, (g, n) in self._kept.items()
                if g < generation or not store.check([f"{p}0"])  # older, or read by all
            ]
            for p, n in gone:
                self._drop_locked(store, p, n)
            for part, piece in enumerate(cut(blob)):
                store.set(f"{prefix}{part}", piece)  # type: ignore[arg-type]
            self._kept[prefix] = (generation, pieces(len(blob)))
        return pieces(len(blob))

    def drop(self, prefix: str) -> None:
        """Stop serving ``prefix`` (nobody reads it)."""
        store = self._serving()
        with self._lock:
            kept = self._kept.get(prefix)
            if kept is not None:
                self._drop_locked(store, prefix, kept[1])

    def _drop_locked(self, store: dist.Store, prefix: str, parts: int) -> None:
        for part in range(parts):
            store.delete_key(f"{prefix}{part}")
        store.delete_key(f"{prefix}{READ_COUNT}")
        self._kept.pop(prefix, None)

    def serving(self) -> list[str]:
        """The prefixes served now (what the tests look at)."""
        with self._lock:
            return sorted(self._kept)


class RoundsInEtcd:
    """A generation's rounds: records in etcd, each carrier's bytes in its
    :class:`PieceServer` (see the module docstring).

    Args:
        client: etcd (shared with the session; used from the rounds' threads).
        job: the job.
        generation: the generation the rounds belong to.
        server: this process's piece server.
    """

    def __init__(self, client: EtcdClient, job: str, generation: int, server: PieceServer) -> None:
        self._client = client
        self._job = job
        self.generation = generation
        self.server = server
        server.forget_before(generation)
        self._pruned = False
        #: fragment -> the rounds (their ``at``) site 0's first carrier opened, not pruned
        self._opened: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def prefix(self, place: RoundPlace) -> str:
        """The etcd prefix of ``place``'s round."""
        return keys.outer_round(self._job, self.generation, place.fragment, place.at)

    def open(self, place: RoundPlace, stop: threading.Event) -> RoundLink:
        first = False
        if place.site == 0 and place.slot == 0:
            with self._lock:
                first, self._pruned = not self._pruned, True
                self._opened.setdefault(place.fragment, []).append(place.at)
        return _EtcdLink(self, place, stop, prune=first)

    def prune(self, link: _EtcdLink) -> None:
        """Drop the rounds of older generations (site 0's first carrier, at its first
        round: every older round was started again in this generation, or finished)."""
        root = keys.job_prefix(self._job) + "pg/"
        found = link.attempt(lambda: self._client.get_keys(root), "older generations' rounds")
        with_rounds = {k[len(root) :].split("/")[0] for k in found or () if "/outer/" in k}
        for name in with_rounds:
            if name.isdigit() and int(name) < self.generation:
                self.drop(link, keys.outer_rounds(self._job, int(name)))

    def drop(self, link: _EtcdLink, prefix: str) -> None:
        """Delete ``prefix``'s records, best effort (the run's end clears what is left)."""
        link.attempt(lambda: self._client.delete_prefix(prefix), prefix)

    def passed(self, place: RoundPlace) -> list[str]:
        """Every site offered to ``place``'s round: the fragment's earlier rounds, which
        site 0's first carrier opened and now forgets (each site applied them: a round's
        result is applied before the fragment's next round starts).  Their records go,
        so a generation keeps a few rounds per fragment in etcd, not one per outer step."""
        if place.site != 0 or place.slot != 0:
            return []
        with self._lock:
            opened = self._opened.get(place.fragment, [])
            self._opened[place.fragment] = [at for at in opened if at >= place.at]
        return [
            keys.outer_round(self._job, self.generation, place.fragment, at)
            for at in opened
            if at < place.at
        ]


@dataclass
class _Outage:
    """How long one round has waited for etcd: the outages it met, and the call under
    way (which may be meeting one: its time is left out of the round's until it
    answers; then only an outage's is)."""

    past: float = 0.0
    since: float | None = None

    def begin(self) -> None:
        self.since = time.monotonic()

    def answered(self) -> None:
        self.since = None

    def ended(self) -> None:
        """The call under way met an outage, now over: its time counts as one."""
        if self.since is not None:
            self.past += time.monotonic() - self.since
            self.since = None

    def seconds(self) -> float:
        since = self.since  # read once: the round's thread may end the outage meanwhile
        return self.past + (time.monotonic() - since if since is not None else 0.0)


class _EtcdLink:
    def __init__(
        self, medium: RoundsInEtcd, place: RoundPlace, stop: threading.Event, prune: bool
    ) -> None:
        self.medium, self.place, self.stop = medium, place, stop
        self._outage = _Outage()
        self._prune = prune
        self.records = medium.prefix(place)
        self.client = medium._client
        self.pieces = f"g{medium.generation}/{place.name}"  # on each carrier's server
        self._sources: dict[str, dist.TCPStore] = {}

    def attempt(self, fn: Callable[[], T], what: str) -> T | None:
        """``fn`` against etcd once, for housekeeping: an error is logged, not raised (it
        neither fails the round nor waits out an outage; its time counts as the
        outage's while it runs)."""
        self._outage.begin()
        try:
            result = fn()
        except EtcdError as e:
            self._outage.ended()
            log.warning("outer sync: %s not pruned: %s", what, e)
            return None
        self._outage.answered()
        return result

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn`` against etcd, an outage waited out until the round is cancelled (and
        timed: :meth:`outage_s`)."""
        self._outage.begin()
        try:
            result = fn()
        except EtcdUnavailableError:
            try:
                return retry_unavailable(fn, f"outer sync: {what}", stop=self.stop)
            finally:
                self._outage.ended()
        self._outage.answered()
        return result

    def outage_s(self) -> float:
        return self._outage.seconds()

    def put(self, blob: bytes) -> tuple[int, str]:
        parts = self.medium.server.keep(self.medium.generation, self.pieces, blob)
        return parts, self.medium.server.address

    def offer(self, offer: Offer) -> None:
        if self._prune:  # at site 0's first round of the generation
            self.medium.prune(self)
        key = f"{self.records}offer/{self.place.site}/{self.place.slot}"
        self.call(lambda: self.client.put(key, offer.encode()), "offer")

    def look(self) -> tuple[dict[tuple[int, int], Offer], RoundDecision | None]:
        found = self.call(lambda: self.client.get_prefix(self.records), "read offers")
        offers: dict[tuple[int, int], Offer] = {}
        decision = None
        for kv in found:
            name = kv.key[len(self.records) :]
            if name == "decision":
                decision = RoundDecision.decode(kv.value)
            elif name.startswith("offer/"):
                site, slot = name.split("/")[1:3]
                offers[int(site), int(slot)] = Offer.decode(kv.value)
        return offers, decision

    def decide(self, decision: RoundDecision) -> RoundDecision:
        key = self.records + "decision"
        created, current = self.call(
            lambda: self.client.compare_and_set(key, decision.encode(), None), "decide"
        )
        if created or current is None:
            return decision
        return RoundDecision.decode(current.value)

    def fetch(self, site: int, offer: Offer) -> bytes:
        source = self._source(offer.source)
        blob = read_pieces(source, self.pieces, offer.parts)
        try:
            if source.add(f"{self.pieces}{READ_COUNT}", 1) == self.place.sites - 1:
                for part in range(offer.parts):  # every other site has it: the last cleans up
                    source.delete_key(f"{self.pieces}{part}")
                source.delete_key(f"{self.pieces}{READ_COUNT}")
        except (RuntimeError, OSError) as e:  # read already: the source may just be gone
            log.debug("round %s: cleaning up %s: %s", self.place.name, offer.source, e)
        return blob

    def _source(self, address: str) -> dist.TCPStore:
        if address not in self._sources:
            host, _, port = address.rpartition(":")
            self._sources[address] = dist.TCPStore(
                host, int(port), is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False
            )
        return self._sources[address]

    def finish(self, decision: RoundDecision, offers: dict[tuple[int, int], Offer]) -> None:
        if not decision.read_from(self.place.site):  # nobody reads its pseudo-gradient
            self.medium.server.drop(self.pieces)
        self._sources.clear()
        if len(decision.sites) == self.place.sites:
            for prefix in self.medium.passed(self.place):
                self.medium.drop(self, prefix)
