"""One round of an outer sync between sites.

Runs in the training process, in a thread of its own per round (on a site's
leader, or on every rank of an FSDP2 site: each carries its own slice), so
that the round's bytes travel while the next inner steps compute.  The rules
(who takes part, what is agreed) are in :mod:`agents.sync.rounds`; where the
round's records and bytes are kept is its medium's
(:mod:`agents.sync.round_media`).  This module runs the round:

1. the site's pseudo-gradient is put where the other sites read it, in pieces
   of at most :data:`~agents.sync.round_media.PIECE_BYTES`, then its offer
   says where;
2. the thread reads the offers until the round may be decided, and then
   creates the decision record unless another site did first (one decision
   per round, whoever wins);
3. it reads the pseudo-gradients of the sites that take part, decodes them
   and hands them over with the decision; what nobody reads any more is
   dropped.

Sites that are not there never hold the others: the round goes ahead with
those that are (``quorum``) once ``timeout`` has passed.  A round of a broken
generation is given up (:meth:`RoundExchange.cancel` ends the thread), and
the new generation starts it again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from agents.sync.round_media import PIECE_BYTES, RoundLink, RoundMedium, RoundPlace
from agents.sync.rounds import Offer, RoundDecision, decide, ready
from orchestrator.settings import SETTINGS

__all__ = ["PIECE_BYTES", "RoundExchange", "RoundPlace", "RoundResult"]

#: How often a waiting round reads the offers: first, and at most (a pause is also at
#: most a twentieth of the wait so far, so a long wait reads its medium less often).
_POLL_FIRST_S = 0.002
_POLL_MAX_S = 0.5


@dataclass(frozen=True)
class RoundResult:
    """A decided round as this carrier saw it: the decision, and the pseudo-gradients of
    the sites that take part with a weight above 0, in site order (still encoded)."""

    decision: RoundDecision
    received: list[tuple[float, list[torch.Tensor]]]
    #: bytes read from other sites for their pseudo-gradients
    bytes_read: int
    #: seconds from the start of the round to its decision, as this carrier saw it
    waited_s: float


class RoundExchange:
    """Offers one site's pseudo-gradient to a round and brings back the round's decision.

    Args:
        medium: where the round's records and bytes are kept.
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
        medium: RoundMedium,
        place: RoundPlace,
        payload: Sequence[torch.Tensor],
        like: Callable[[], list[torch.Tensor]],
        offer: Offer,
        quorum: int,
        timeout: timedelta,
    ) -> None:
        self.place = place
        self._medium = medium
        self._blob = _to_bytes(payload)
        self._like = like
        self._offer = offer
        self._quorum = quorum
        self._timeout = timeout.total_seconds()
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._result: RoundResult | None = None
        self._link: RoundLink | None = None  # set by the round's thread
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
        before = self._outage_s()  # an outage of the medium while waiting pauses the wait,
        while not self._done.wait(0.05):  # up to the time a worker waits for a plan
            if moved_on():
                self.cancel()
                raise RuntimeError(
                    f"outer sync of fragment {self.place.fragment} (started at step "
                    f"{self.place.at}): a newer generation is published"
                )
            paused = min(self._outage_s() - before, SETTINGS.plan_timeout.total_seconds())
            if time.monotonic() > deadline + paused:
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

    def _outage_s(self) -> float:
        link = self._link
        return link.outage_s() if link is not None else 0.0

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
        link = self._link = self._medium.open(place, self._cancelled)
        parts, source = link.put(self._blob)
        link.offer(dataclasses.replace(self._offer, parts=parts, source=source))
        decision, offers = self._decision(link)
        waited = time.monotonic() - began
        received: list[tuple[float, list[torch.Tensor]]] = []
        read = 0
        for site, weight in zip(decision.sites, decision.weights, strict=True):
            if not decision.read_from(site):
                continue
            if site == place.site:
                blob = self._blob
            else:
                blob = link.fetch(site, offers[site, place.slot])
                read += len(blob)
            received.append((weight, _from_bytes(blob, self._like())))
        link.finish(decision, offers)
        return RoundResult(decision, received, read, waited)

    def _decision(self, link: RoundLink) -> tuple[RoundDecision, dict[tuple[int, int], Offer]]:
        """The round's decision (read, or made here once it may go ahead), with the
        offers present when it was seen."""
        place = self.place
        poll, first_seen = _POLL_FIRST_S, time.monotonic()
        while True:
            if self._cancelled.is_set():
                raise RuntimeError("cancelled: the generation broke")
            offers, decision = link.look()
            if decision is not None:
                return decision, offers
            complete = {  # the sites whose every carrier offered, by their first carrier's
                site: offers[site, 0]
                for site in range(place.sites)
                if all((site, slot) in offers for slot in range(place.carriers))
            }
            waited = time.monotonic() - first_seen
            if ready(len(complete), place.sites, self._quorum, waited, self._timeout):
                decision = link.decide(decide(complete))
                while any((site, place.slot) not in offers for site in decision.sites):
                    if self._cancelled.is_set():  # another carrier's decision, from a later
                        raise RuntimeError("cancelled: the generation broke")  # look
                    time.sleep(_POLL_FIRST_S)
                    offers, _ = link.look()
                return decision, offers
            time.sleep(poll)
            poll = min(_POLL_MAX_S, max(poll * 2, waited / 20))


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
