"""One round of an outer sync between sites, carried through the generation's store.

Runs in the training process, in a thread of its own per round (on a site's
leader, or on every rank of an FSDP2 site: each carries its own slice), so
that the round's bytes travel while the next inner steps compute.  The rules
(who takes part, what is agreed) are :mod:`agents.sync.rounds`'; this module
does the I/O:

1. the site's pseudo-gradient goes into the store in pieces of at most
   :data:`PIECE_BYTES` (the store refuses values above 8 MiB), then its offer;
2. the thread reads the offers until the round may be decided, and then
   creates the decision record unless another site did first (a
   compare-and-set on an absent key: one decision per round, whoever wins);
3. it reads the pseudo-gradients of the sites that take part, decodes them
   and hands them over with the decision; the last site to have read them
   deletes the round's data.

The store is the generation's bootstrap store (hosted by its rank 0), reached
through a connection of the thread's own.  Sites that are not there never
hold the others: the round goes ahead with those that are (``quorum``) once
``timeout`` has passed.  A round of a broken generation dies with its store:
:meth:`RoundExchange.cancel` ends the thread, and the new generation starts
the round again in its own store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from agents.sync.rounds import Offer, RoundDecision, decide, ready

__all__ = ["PIECE_BYTES", "RoundExchange", "RoundPlace", "RoundResult", "generation_store"]

#: Largest value the exchange writes to the store (torch's store takes up to 8 MiB).
PIECE_BYTES = 4 << 20
#: How often a waiting round reads the offers: first, and at most.
_POLL_FIRST_S = 0.002
_POLL_MAX_S = 0.05


@dataclass(frozen=True)
class RoundPlace:
    """Where a round is: the generation's store, and who this carrier is in it.

    Attributes:
        connect: opens the generation's store (:func:`generation_store`).
        fragment: the fragment synced.
        at: the steps complete when the round started (with the fragment, its name).
        site: this carrier's site.
        sites: the number of sites in the generation.
        carriers: carriers per site (1, or each site's ranks for FSDP2 slices).
        slot: this carrier's index in its site (its slice; 0 for a leader).
    """

    connect: Callable[[], dist.Store]
    fragment: int
    at: int
    site: int
    sites: int
    carriers: int = 1
    slot: int = 0

    @property
    def prefix(self) -> str:
        return f"ringmaster-outer/f{self.fragment}/a{self.at}/"

    def data_key(self, site: int, part: int) -> str:
        return f"data/{site}/{self.slot}/{part}"

    def offer_key(self, site: int, slot: int) -> str:
        return f"offer/{site}/{slot}"


@dataclass(frozen=True)
class RoundResult:
    """A decided round as this carrier saw it: the decision, and the pseudo-gradients of
    the sites that take part with a weight above 0, in site order (still encoded)."""

    decision: RoundDecision
    received: list[tuple[float, list[torch.Tensor]]]
    #: bytes read from the store for the other sites' pseudo-gradients
    bytes_read: int
    #: seconds from the start of the round to its decision, as this carrier saw it
    waited_s: float


class RoundExchange:
    """Offers one site's pseudo-gradient to a round and brings back the round's decision.

    Args:
        place: the round and this carrier's place in it.
        payload: the encoded pseudo-gradient (:func:`agents.sync.quantize.encode`).
        like: empty tensors of the payload's shapes and dtypes, for reading another
            site's (:func:`agents.sync.quantize.empty_like_payload`).
        offer: this site's weight and vote.
        quorum: the least number of sites that may go ahead without the others.
        timeout: how long after the first offer the others are waited for.
    """

    def __init__(
        self,
        place: RoundPlace,
        payload: Sequence[torch.Tensor],
        like: Callable[[], list[torch.Tensor]],
        offer: Offer,
        quorum: int,
        timeout: timedelta,
    ) -> None:
        self.place = place
        self._blob = _to_bytes(payload)
        self._like = like
        self._offer = Offer(offer.weight, offer.agreement, _pieces(len(self._blob)))
        self._quorum = quorum
        self._timeout = timeout.total_seconds()
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._result: RoundResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"outer-round-f{place.fragment}-a{place.at}", daemon=True
        )
        self._thread.start()

    def cancel(self) -> None:
        """Stop taking part (the generation broke): the thread ends at its next look."""
        self._cancelled.set()

    def wait(self, moved_on: Callable[[], bool], limit_s: float) -> RoundResult:
        """The round's result, once decided and read.

        Raises:
            RuntimeError: the generation moved on, or ``limit_s`` passed, before
                the round was decided (the session treats it as a peer's failure),
                or the store failed.
        """
        deadline = time.monotonic() + limit_s
        while not self._done.wait(0.05):
            if moved_on():
                self.cancel()
                raise RuntimeError(
                    f"outer sync of fragment {self.place.fragment} (started at step "
                    f"{self.place.at}): a newer generation is published"
                )
            if time.monotonic() > deadline:
                self.cancel()
                raise RuntimeError(
                    f"outer sync of fragment {self.place.fragment} (started at step "
                    f"{self.place.at}) timed out after {limit_s:.0f} s: fewer than "
                    f"sync.quorum sites reached it"
                )
        if self._error is not None:
            raise RuntimeError(
                f"outer sync of fragment {self.place.fragment}: {self._error}"
            ) from (self._error)
        assert self._result is not None
        return self._result

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._result = self._carry()
        except BaseException as e:  # handed to wait(), in the training thread
            self._error = e
        finally:
            self._done.set()

    def _carry(self) -> RoundResult:
        place, began = self.place, time.monotonic()
        store = dist.PrefixStore(place.prefix, place.connect())
        for part in range(self._offer.parts):
            piece = self._blob[part * PIECE_BYTES : (part + 1) * PIECE_BYTES]
            store.set(place.data_key(place.site, part), piece)  # type: ignore[arg-type]
        store.set(place.offer_key(place.site, place.slot), self._offer.encode())
        decision = self._decision(store)
        waited = time.monotonic() - began
        received: list[tuple[float, list[torch.Tensor]]] = []
        read = 0
        for site, weight, parts in zip(
            decision.sites, decision.weights, decision.parts, strict=True
        ):
            if weight <= 0:
                continue
            if site == place.site:
                blob = self._blob
            else:
                blob = b"".join(_get(store, place.data_key(site, part)) for part in range(parts))
                read += len(blob)
            received.append((weight, _from_bytes(blob, self._like())))
        if store.add(f"read/{place.slot}", 1) == place.sites:  # the last reader cleans up
            for site in range(place.sites):
                parts = Offer.decode(store.get(place.offer_key(site, place.slot))).parts
                for part in range(parts):
                    store.delete_key(place.data_key(site, part))
        return RoundResult(decision, received, read, waited)

    def _decision(self, store: dist.Store) -> RoundDecision:
        place = self.place
        offers: dict[int, Offer] = {}
        poll, first_seen = _POLL_FIRST_S, time.monotonic()
        while True:
            if self._cancelled.is_set():
                raise RuntimeError("cancelled: the generation broke")
            if store.check(["decision"]):
                return RoundDecision.decode(store.get("decision"))
            self._read_offers(store, offers)
            waited = time.monotonic() - first_seen
            if ready(len(offers), place.sites, self._quorum, waited, self._timeout):
                mine = decide(offers).encode()
                return RoundDecision.decode(store.compare_set("decision", "", mine))
            time.sleep(poll)
            poll = min(_POLL_MAX_S, poll * 2)

    def _read_offers(self, store: dist.Store, offers: dict[int, Offer]) -> None:
        """Add to ``offers`` the sites whose every carrier has offered since the last look
        (with the first carrier's offer); an offer once read is not read again."""
        place = self.place
        for site in range(place.sites):
            keys = [place.offer_key(site, slot) for slot in range(place.carriers)]
            if site not in offers and store.check(keys):
                offers[site] = Offer.decode(store.get(keys[0]))


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
        host, port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False
    )


def _get(store: dist.Store, key: str) -> bytes:
    value = store.get(key)
    return bytes(value)


def _pieces(size: int) -> int:
    return max(1, -(-size // PIECE_BYTES))


def _to_bytes(payload: Sequence[torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in payload)


def _from_bytes(blob: bytes, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        flat = torch.frombuffer(bytearray(blob[offset : offset + n]), dtype=torch.uint8)
        out.append(flat.view(t.dtype).view(t.shape).clone() if n else t)
        offset += n
    if offset != len(blob):
        raise RuntimeError(f"a pseudo-gradient of {len(blob)} bytes where {offset} were expected")
    return out
