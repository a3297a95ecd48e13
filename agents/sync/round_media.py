"""Where a round of an outer sync keeps its records and its bytes.

Runs in the training process, in a round's thread
(:class:`agents.sync.round_exchange.RoundExchange`).  A round has two kinds of
things to keep: small *records* (each carrier's offer, the one decision) that
every site reads and one site creates, and each carrier's encoded
pseudo-gradient (megabytes) that the other sites read once.  A
:class:`RoundMedium` opens a :class:`RoundLink` per round; two media:

* :class:`RoundsInEtcd`, what the runtime uses: the records in etcd, under the
  generation's key (``/ringmaster/jobs/<job>/pg/<gen>/outer/f<f>/a<at>/``), the
  decision created only where none exists (a transaction); each carrier
  serves its own pseudo-gradients from a ``TCPStore`` of its own
  (:class:`PieceServer`, its address in its offer), so a round's bytes go from
  the site that made them straight to the site that reads them, and no round
  lives in a store that another site hosts.  An etcd outage is waited out
  (the round's own wait limit still applies).
* :class:`RoundsInStore`: everything in one c10d store, the generation's
  bootstrap store by default (a worker outside a session, the tests' threads).

Both keep a round to its generation: a round of a broken generation is
started again under the new one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, TypeVar

import torch.distributed as dist

from agents.sync.rounds import Offer, RoundDecision
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.state import keys

__all__ = [
    "PIECE_BYTES",
    "STORE_PREFIX",
    "PieceServer",
    "RoundLink",
    "RoundMedium",
    "RoundPlace",
    "RoundsInEtcd",
    "RoundsInStore",
    "generation_store",
]

T = TypeVar("T")

#: Largest value written to a store (torch's store takes up to 8 MiB).
PIECE_BYTES = 4 << 20
#: Where :class:`RoundsInStore` keeps the rounds in its store (a ``PrefixStore`` adds
#: the "/" between a round's name and its keys).
STORE_PREFIX = "ringmaster-outer/"
#: How long a reader's store connection waits for an answer.
_STORE_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class RoundPlace:
    """One round, and who this carrier is in it.

    Attributes:
        fragment: the fragment synced.
        at: the steps complete when the round started (with the fragment, its name).
        site: this carrier's site.
        sites: the number of sites in the generation.
        carriers: carriers per site (1, or each site's ranks for FSDP2 slices).
        slot: this carrier's index in its site (its slice; 0 for a leader).
    """

    fragment: int
    at: int
    site: int
    sites: int
    carriers: int = 1
    slot: int = 0

    @property
    def name(self) -> str:
        return f"f{self.fragment}/a{self.at}/"


class RoundLink(Protocol):
    """One carrier's access to one round's records and bytes (used from one thread)."""

    def put(self, blob: bytes) -> Offer:
        """Keep this carrier's pseudo-gradient where the other sites read it; returns an
        offer (weight 0, no vote) saying how many pieces it is and where it is."""
        ...

    def offer(self, offer: Offer) -> None:
        """Publish this carrier's offer (after :meth:`put`)."""
        ...

    def look(self) -> tuple[dict[tuple[int, int], Offer], RoundDecision | None]:
        """The offers present, by (site, slot), and the decision if there is one."""
        ...

    def decide(self, decision: RoundDecision) -> RoundDecision:
        """Create ``decision`` unless one exists; returns the one that stands."""
        ...

    def fetch(self, site: int, offer: Offer) -> bytes:
        """``site``'s pseudo-gradient for this carrier's slot (``offer``: that carrier's)."""
        ...

    def finish(self, decision: RoundDecision, offers: dict[tuple[int, int], Offer]) -> None:
        """This carrier is done with the round: drop what nobody reads any more."""
        ...


class RoundMedium(Protocol):
    """Opens a round's :class:`RoundLink` (in the round's thread; ``stop``: the round
    was cancelled, an etcd outage is no longer waited out)."""

    def open(self, place: RoundPlace, stop: threading.Event) -> RoundLink: ...


def pieces(size: int) -> int:
    """How many stored values a pseudo-gradient of ``size`` bytes takes."""
    return max(1, -(-size // PIECE_BYTES))


def _cut(blob: bytes) -> Iterator[bytes]:
    for part in range(pieces(len(blob))):
        yield blob[part * PIECE_BYTES : (part + 1) * PIECE_BYTES]


def _read(store: dist.Store, prefix: str, parts: int) -> bytes:
    return b"".join(bytes(store.get(f"{prefix}{part}")) for part in range(parts))


# -- everything in one store ----------------------------------------------------------


class RoundsInStore:
    """Records and bytes in one c10d store (``connect`` opens it; by default the
    generation's bootstrap store, :func:`generation_store`)."""

    def __init__(self, connect: Callable[[], dist.Store] | None = None) -> None:
        self._connect = connect

    def open(self, place: RoundPlace, stop: threading.Event) -> RoundLink:
        connect = self._connect or generation_store()
        return _StoreLink(place, dist.PrefixStore(STORE_PREFIX + place.name.rstrip("/"), connect()))


class _StoreLink:
    def __init__(self, place: RoundPlace, store: dist.Store) -> None:
        self.place, self.store = place, store

    def _data(self, site: int) -> str:
        return f"data/{site}/{self.place.slot}/"

    def put(self, blob: bytes) -> Offer:
        for part, piece in enumerate(_cut(blob)):
            self.store.set(f"{self._data(self.place.site)}{part}", piece)  # type: ignore[arg-type]
        return Offer(0.0, (), pieces(len(blob)))

    def offer(self, offer: Offer) -> None:
        self.store.set(f"offer/{self.place.site}/{self.place.slot}", offer.encode())

    def look(self) -> tuple[dict[tuple[int, int], Offer], RoundDecision | None]:
        decision = None
        if self.store.check(["decision"]):
            decision = RoundDecision.decode(self.store.get("decision"))
        offers: dict[tuple[int, int], Offer] = {}
        for site in range(self.place.sites):
            for slot in range(self.place.carriers):
                key = f"offer/{site}/{slot}"
                if self.store.check([key]):
                    offers[site, slot] = Offer.decode(self.store.get(key))
        return offers, decision

    def decide(self, decision: RoundDecision) -> RoundDecision:
        return RoundDecision.decode(self.store.compare_set("decision", "", decision.encode()))

    def fetch(self, site: int, offer: Offer) -> bytes:
        return _read(self.store, self._data(site), offer.parts)

    def finish(self, decision: RoundDecision, offers: dict[tuple[int, int], Offer]) -> None:
        place = self.place
        if self.store.add(f"read/{place.slot}", 1) != place.sites:
            return
        for site in range(place.sites):  # the last reader of this slot cleans up
            parts = Offer.decode(self.store.get(f"offer/{site}/{place.slot}")).parts
            for part in range(parts):
                self.store.delete_key(f"{self._data(site)}{part}")


def generation_store() -> Callable[[], dist.Store]:
    """How a round's thread reaches the default group's store (the generation's
    bootstrap store): a connection of its own to a ``TCPStore``, else the store itself
    (an in-process one)."""
    from torch.distributed import distributed_c10d

    store: dist.Store = distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        base = store
        return lambda: base
    host, port = store.host, store.port
    return lambda: dist.TCPStore(
        host, port, is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False
    )


# -- records in etcd, bytes served by each carrier -------------------------------------


@dataclass
class PieceServer:
    """This process's store of its own pseudo-gradients, read by the other sites.

    A ``TCPStore`` listening on a port the system picks (on every interface;
    ``host`` is the address the other sites reach this node at), started at
    the first :meth:`keep` and kept for the life of the process.  A round's
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

    def _serving(self) -> dist.TCPStore:
        with self._lock:
            if self._store is None:
                self._store = dist.TCPStore(
                    self.host, 0, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT
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
            for part, piece in enumerate(_cut(blob)):
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
        self._kept.pop(prefix, None)

    def serving(self) -> list[str]:
        """The prefixes served now (for tests and telemetry)."""
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
        self._pruned = False

    def prefix(self, place: RoundPlace) -> str:
        """The etcd prefix of ``place``'s round."""
        return keys.outer_round(self._job, self.generation, place.fragment, place.at)

    def open(self, place: RoundPlace, stop: threading.Event) -> RoundLink:
        if place.site == 0 and place.slot == 0 and not self._pruned:
            self._pruned = True
            self._prune(stop)
        return _EtcdLink(self, place, stop)

    def _prune(self, stop: threading.Event) -> None:
        """Drop the rounds of older generations (once per generation, by site 0's first
        carrier: every older round was started again in this one, or finished)."""
        root = keys.job_prefix(self._job) + "pg/"
        names = self.retry(lambda: self._client.child_names(root), "list generations", stop)
        for name in names:
            if name.isdigit() and int(name) < self.generation:
                self._drop(keys.outer_rounds(self._job, int(name)), stop)

    def _drop(self, prefix: str, stop: threading.Event) -> None:
        self.retry(lambda: self._client.delete_prefix(prefix), "prune rounds", stop)

    def retry(self, fn: Callable[[], T], what: str, stop: threading.Event) -> T:
        """``fn`` against etcd, an outage waited out until ``stop`` is set."""
        return retry_unavailable(fn, f"outer sync: {what}", stop=stop)


class _EtcdLink:
    def __init__(self, medium: RoundsInEtcd, place: RoundPlace, stop: threading.Event) -> None:
        self.medium, self.place, self.stop = medium, place, stop
        self.records = medium.prefix(place)
        self.client = medium._client
        self.pieces = f"g{medium.generation}/{place.name}"  # on each carrier's server
        self._sources: dict[str, dist.TCPStore] = {}

    def put(self, blob: bytes) -> Offer:
        parts = self.medium.server.keep(self.medium.generation, self.pieces, blob)
        return Offer(0.0, (), parts, source=self.medium.server.address)

    def offer(self, offer: Offer) -> None:
        key = f"{self.records}offer/{self.place.site}/{self.place.slot}"
        self.medium.retry(lambda: self.client.put(key, offer.encode()), "offer", self.stop)

    def look(self) -> tuple[dict[tuple[int, int], Offer], RoundDecision | None]:
        found = self.medium.retry(
            lambda: self.client.get_prefix(self.records), "read offers", self.stop
        )
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
        created, current = self.medium.retry(
            lambda: self.client.compare_and_set(key, decision.encode(), None), "decide", self.stop
        )
        if created or current is None:
            return decision
        return RoundDecision.decode(current.value)

    def fetch(self, site: int, offer: Offer) -> bytes:
        source = self._source(offer.source)
        blob = _read(source, self.pieces, offer.parts)
        if source.add(f"{self.pieces}read", 1) == self.place.sites - 1:
            for part in range(offer.parts):  # every other site has it: the last one cleans up
                source.delete_key(f"{self.pieces}{part}")
        return blob

    def _source(self, address: str) -> dist.TCPStore:
        if address not in self._sources:
            host, _, port = address.rpartition(":")
            self._sources[address] = dist.TCPStore(
                host, int(port), is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False
            )
        return self._sources[address]

    def finish(self, decision: RoundDecision, offers: dict[tuple[int, int], Offer]) -> None:
        site = self.place.site
        weighed = site in decision.sites and decision.weights[decision.sites.index(site)] > 0
        if not weighed:  # nobody reads this carrier's pseudo-gradient
            self.medium.server.drop(self.pieces)
        self._sources.clear()
