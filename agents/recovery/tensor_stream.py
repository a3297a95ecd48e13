"""Move a list of tensors from one rank (or several) to others in fixed-size chunks, no flat copy.

Runs in the training process, under :mod:`~agents.recovery.state_sync`.  Both
sides know the tensors' sizes in order (the sender pickled the structure
beforehand), so both cut the same byte stream into the same *runs*: a tensor
of at least :data:`DIRECT_BYTES` travels straight from the sender's memory
into the receiver's, in slices of at most ``chunk_bytes``; smaller tensors are
packed together into a staging buffer of at most ``chunk_bytes`` (the sender
copies them in, the receiver copies them out).  Every tensor travels as its
bytes, whatever its dtype, so bools, bfloat16 and the rest need no special
case.  Up to :data:`IN_FLIGHT` runs are posted at once, so packing the next
run (or unpacking the last) overlaps with the wire; two staging buffers take
turns.

Peak memory on either side is therefore the tensors themselves plus two
staging buffers (sized to the largest packed run, never more than
``chunk_bytes``), instead of a second copy of everything.

Where several ranks hold the same tensors, each may send a share of them
(:func:`transfer_from`: each tensor from its owner, the owners' runs taken in
turn, so all send at once).  Host tensors go point to point (gloo
``isend``/``irecv``) to the receivers only; device tensors go by a collective
``broadcast`` on the data group (NCCL, or gloo over CUDA tensors), in which a
rank that needs none of the bytes takes part with a scratch buffer.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "CHUNK_BYTES",
    "DIRECT_BYTES",
    "IN_FLIGHT",
    "Route",
    "Run",
    "interleaved_runs",
    "runs",
    "transfer",
    "transfer_from",
]

#: The most bytes one message carries (a direct slice or a packed run).  64 MiB
#: measured as fast as 256 MiB on loopback gloo, for a quarter of the staging memory.
CHUNK_BYTES = 64 << 20
#: A tensor at least this large travels without a staging copy on either side.
DIRECT_BYTES = 1 << 20
#: Runs posted before the oldest one is waited for.
IN_FLIGHT = 4
#: The point-to-point tag of state transfers (gloo matches messages per tag, in order).
_TAG = 4242


@dataclass(frozen=True)
class Route:
    """How tensors of one device kind travel.

    Attributes:
        group: the process group (None: the default group).
        broadcast: True for a collective broadcast on ``group`` (every rank takes
            part), False for point to point from the source to the receivers only.
        device: where this route's tensors and staging buffers live on this rank.
    """

    group: dist.ProcessGroup | None
    broadcast: bool
    device: torch.device


@dataclass(frozen=True)
class Run:
    """One message: byte ranges ``(tensor index, start, stop)`` sent back to back.

    A direct run is one slice of one tensor, sent from and received into the
    tensor's own memory; a packed run goes through a staging buffer.
    """

    pieces: tuple[tuple[int, int, int], ...]
    direct: bool

    @property
    def nbytes(self) -> int:
        return sum(stop - start for _, start, stop in self.pieces)


def runs(sizes: Sequence[int], chunk_bytes: int, direct_bytes: int = DIRECT_BYTES) -> list[Run]:
    """The messages that carry tensors of ``sizes`` bytes, in order (the same on every rank).

    A tensor of at least ``min(direct_bytes, chunk_bytes)`` bytes is sent by
    itself in slices of ``chunk_bytes``; consecutive smaller ones share a
    packed run of at most ``chunk_bytes``.  Empty tensors need no message.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
    out: list[Run] = []
    packed: list[tuple[int, int, int]] = []
    filled = 0

    def flush() -> None:
        nonlocal packed, filled
        if packed:
            out.append(Run(tuple(packed), False))
        packed, filled = [], 0

    for i, size in enumerate(sizes):
        if size == 0:
            continue
        if size >= min(direct_bytes, chunk_bytes):
            flush()
            for start in range(0, size, chunk_bytes):
                out.append(Run(((i, start, min(size, start + chunk_bytes)),), True))
            continue
        if filled + size > chunk_bytes:
            flush()
        packed.append((i, 0, size))
        filled += size
    flush()
    return out


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat ``uint8`` view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def transfer(
    tensors: Sequence[torch.Tensor] | None,
    sizes: Sequence[int],
    src: int,
    receivers: Sequence[int],
    route: Route,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Send ``tensors`` from ``src`` to ``receivers``, or receive them: collective on the route.

    Args:
        tensors: on the source, the tensors to send; on a receiver, the
            tensors to fill (contiguous; each as large as its size); on any
            other rank, None.
        sizes: every tensor's bytes, in order, the same on every rank.
        src: the sending rank (global rank, as ``torch.distributed`` numbers it).
        receivers: the ranks that take the tensors (not ``src``).
        route: how the bytes travel.
        chunk_bytes: the most bytes of one message.

    Returns:
        The bytes this rank sent (to each receiver) or received; 0 on a bystander.
    """
    if not sizes:
        return 0  # nothing to move: no message
    return transfer_from([src] * len(sizes), tensors, sizes, receivers, route, chunk_bytes)


def interleaved_runs(
    owners: Sequence[int], sizes: Sequence[int], chunk_bytes: int
) -> list[tuple[Run, int]]:
    """The messages of tensors sent by several ranks: each owner's tensors cut as
    :func:`runs` cuts them (a packed run holds one owner's tensors only), the owners'
    runs taken in turn so that every sender is busy at once; ``(run, its sender)``.
    """
    by_owner: dict[int, list[Run]] = {}
    for owner in dict.fromkeys(owners):
        mine = [i for i, o in enumerate(owners) if o == owner]
        cut = runs([sizes[i] for i in mine], chunk_bytes)
        by_owner[owner] = [
            Run(tuple((mine[i], a, b) for i, a, b in r.pieces), r.direct) for r in cut
        ]
    out: list[tuple[Run, int]] = []
    queues = [(owner, collections.deque(rs)) for owner, rs in by_owner.items()]
    while any(q for _, q in queues):
        for owner, q in queues:
            if q:
                out.append((q.popleft(), owner))
    return out


def transfer_from(
    owners: Sequence[int],
    tensors: Sequence[torch.Tensor] | None,
    sizes: Sequence[int],
    receivers: Sequence[int],
    route: Route,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """:func:`transfer` where tensor ``i`` is sent by rank ``owners[i]``: several ranks that
    hold the same tensors each send a share at once (point to point only: a broadcast
    has one source).

    Args:
        owners: each tensor's sender, the same on every rank.
        tensors: on a sender, its tensors (those it does not send may be anything);
            on a receiver, the tensors to fill; on any other rank, None.

    Returns:
        The bytes this rank sent (to each receiver) or received; 0 on a bystander.
    """
    rank = dist.get_rank()
    sending, receiving = rank in owners, rank in receivers
    if route.broadcast and len(set(owners)) > 1:
        raise ValueError("a broadcast has one source: several senders go point to point")
    if not (sending or receiving or route.broadcast):
        return 0  # point to point: nothing passes through this rank
    if (sending or receiving) != (tensors is not None):
        raise ValueError(f"rank {rank}: tensors given to a bystander, or none to a party")
    if receiving and not all(t.is_contiguous() for t in tensors or ()):
        raise ValueError("a receiver's tensors must be contiguous: their bytes are filled")
    plan = interleaved_runs(owners, sizes, chunk_bytes)
    if not (receiving or route.broadcast):
        plan = [(run, src) for run, src in plan if src == rank]  # a sender's own share

    def staged(run: Run) -> bool:
        """Whether the run goes through a staging buffer on this rank."""
        return not run.direct or tensors is None or tensors[run.pieces[0][0]].device != route.device

    sources = _Sources(tensors if sending and tensors is not None else ())
    staging = _Staging(max((r.nbytes for r, _ in plan if staged(r)), default=0), route.device)
    pending: collections.deque[_Posted] = collections.deque()
    for run, src in plan:
        if len(pending) >= IN_FLIGHT:
            pending.popleft().finish()
        mine = rank == src
        slot = None
        if staged(run):
            slot, buf = staging.take(pending)
            view = buf[: run.nbytes]
            if mine:
                sources.pack(run, view)
        else:  # straight from, or into, the tensor's own memory
            assert tensors is not None
            i, start, stop = run.pieces[0]
            whole = sources.bytes_of(i) if mine else byte_view(tensors[i])
            view = whole[start:stop]
        posted = _Posted(_post(view, mine, src, receivers, route), view)
        if receiving and slot is not None:
            posted.unpack = (tensors, run)
        pending.append(posted)
        if slot is not None:
            staging.last[slot] = posted
    while pending:
        pending.popleft().finish()
    return sum(r.nbytes for r, _ in plan) if (sending or receiving) else 0


def _post(
    view: torch.Tensor, sending: bool, src: int, receivers: Sequence[int], route: Route
) -> list[dist.Work]:
    if route.broadcast:
        work = dist.broadcast(view, src=src, group=route.group, async_op=True)
        assert work is not None
        return [work]
    if sending:
        sends = [dist.isend(view, dst=r, group=route.group, tag=_TAG) for r in receivers]
        return [w for w in sends if w is not None]
    work = dist.irecv(view, src=src, group=route.group, tag=_TAG)
    assert work is not None
    return [work]


class _Posted:
    """A run on the wire: its works, its bytes (kept alive until done), and where to copy
    them out of a staging buffer once they arrived."""

    def __init__(self, works: list[dist.Work], view: torch.Tensor) -> None:
        self.works, self.view = works, view
        self.unpack: tuple[Sequence[torch.Tensor] | None, Run] | None = None
        self.done = False

    def finish(self) -> None:
        if self.done:
            return
        for w in self.works:
            w.wait()
        if self.unpack is not None:
            targets, run = self.unpack
            assert targets is not None
            offset = 0
            for i, start, stop in run.pieces:
                byte_view(targets[i])[start:stop].copy_(self.view[offset : offset + stop - start])
                offset += stop - start
        self.done = True


class _Staging:
    """Two buffers that take turns: one fills (or empties) while the other is on the wire."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self._nbytes, self._device = nbytes, device
        self._bufs: list[torch.Tensor] = []
        self.last: dict[int, _Posted] = {}  # buffer slot -> the last run through it
        self._turn = 0

    def take(self, pending: collections.deque[_Posted]) -> tuple[int, torch.Tensor]:
        """A free buffer (waiting for the run that used it last) and its slot."""
        slot = self._turn % 2
        self._turn += 1
        if slot == len(self._bufs):  # allocated on first use: most plans need one or none
            self._bufs.append(torch.empty(self._nbytes, dtype=torch.uint8, device=self._device))
        last = self.last.get(slot)
        while last is not None and not last.done:  # runs finish in the order posted
            pending.popleft().finish()
        return slot, self._bufs[slot]


class _Sources:
    """The sender's tensors as bytes: in place where contiguous, else made contiguous once."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = tensors
        self._cached: tuple[int, torch.Tensor] | None = None  # one tensor made contiguous

    def bytes_of(self, i: int) -> torch.Tensor:
        t = self._tensors[i].detach()
        if t.is_contiguous():
            return byte_view(t)
        if self._cached is None or self._cached[0] != i:
            self._cached = (i, byte_view(t.contiguous()))
        return self._cached[1]

    def pack(self, run: Run, into: torch.Tensor) -> None:
        offset = 0
        for i, start, stop in run.pieces:
            into[offset : offset + stop - start].copy_(self.bytes_of(i)[start:stop])
            offset += stop - start
