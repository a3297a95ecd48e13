"""Where a round of an outer sync keeps its records and its bytes: the contract.

Runs in the training process, in a round's thread
(:class:`agents.sync.round_exchange.RoundExchange`).  A round has two kinds of
things to keep: small *records* (each carrier's offer, the one decision) that
every site reads and one site creates, and each carrier's encoded
pseudo-gradient (megabytes) that the other sites read once.  A
:class:`RoundMedium` opens a :class:`RoundLink` per round; two media:

* :class:`agents.sync.round_etcd.RoundsInEtcd`, what the runtime uses: the
  records in etcd, each carrier's bytes served by a store of its own;
* :class:`RoundsInStore` (here): everything in one c10d store, the
  generation's bootstrap store (a worker outside a session, the tests'
  threads).

Both keep a round to its generation: a round of a broken generation is
started again under the new one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from agents.sync.rounds import Offer, RoundDecision

__all__ = [
    "PIECE_BYTES",
    "STORE_PREFIX",
    "STORE_TIMEOUT",
    "RoundLink",
    "RoundMedium",
    "RoundPlace",
    "RoundsInStore",
    "cut",
    "generation_store",
    "pieces",
    "read_pieces",
]


#: Largest value written to a store (torch's store takes up to 8 MiB).
PIECE_BYTES = 4 << 20
#: Where :class:`RoundsInStore` keeps the rounds in its store (a ``PrefixStore`` adds
#: the "/" between a round's name and its keys).
STORE_PREFIX = "ringmaster-outer/"
#: How long a reader's store connection waits for an answer.
STORE_TIMEOUT = timedelta(seconds=60)


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

    def put(self, blob: bytes) -> tuple[int, str]:
        """Keep this carrier's pseudo-gradient where the other sites read it; returns how
        many pieces it is and where they are served (:attr:`Offer.source`)."""
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

    def outage_s(self) -> float:
        """Seconds the round has waited for its medium to come back (read from another
        thread: an outage pauses the round, it does not count against its wait limit)."""
        ...


class RoundMedium(Protocol):
    """Opens a round's :class:`RoundLink` (in the round's thread; ``stop``: the round
    was cancelled, an etcd outage is no longer waited out).  Opening waits on no etcd
    call: an outage is timed by the link it returns."""

    def open(self, place: RoundPlace, stop: threading.Event) -> RoundLink: ...


def pieces(size: int) -> int:
    """How many stored values a pseudo-gradient of ``size`` bytes takes."""
    return max(1, -(-size // PIECE_BYTES))


def cut(blob: bytes) -> Iterator[bytes]:
    for part in range(pieces(len(blob))):
        yield blob[part * PIECE_BYTES : (part + 1) * PIECE_BYTES]


def read_pieces(store: dist.Store, prefix: str, parts: int) -> bytes:
    return b"".join(bytes(store.get(f"{prefix}{part}")) for part in range(parts))


# -- everything in one store ----------------------------------------------------------


class RoundsInStore:
    """Records and bytes in one c10d store (``connect`` opens it: for the generation's
    bootstrap store, :func:`generation_store`, taken while that generation is current)."""

    def __init__(self, connect: Callable[[], dist.Store]) -> None:
        self._connect = connect

    def open(self, place: RoundPlace, stop: threading.Event) -> RoundLink:
        prefix = STORE_PREFIX + place.name.rstrip("/")
        return _StoreLink(place, dist.PrefixStore(prefix, self._connect()))


class _StoreLink:
    def __init__(self, place: RoundPlace, store: dist.Store) -> None:
        self.place, self.store = place, store

    def _data(self, site: int) -> str:
        return f"data/{site}/{self.place.slot}/"

    def put(self, blob: bytes) -> tuple[int, str]:
        for part, piece in enumerate(cut(blob)):
            self.store.set(f"{self._data(self.place.site)}{part}", piece)  # type: ignore[arg-type]
        return pieces(len(blob)), ""

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
        return read_pieces(self.store, self._data(site), offer.parts)

    def outage_s(self) -> float:
        return 0.0

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
        host, port, is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False
    )
