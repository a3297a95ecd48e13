"""Move slices of a sharded model between ranks: where each new slice comes from.

At a new generation every rank says which slices it holds (its live one, its
own snapshots, a buddy's copy), each labelled with its step and layout.
:func:`plan` (pure, the same answer on every rank) picks the newest step at
which some old layout is complete (every chunk held by a live rank), and for
every rank of the new layout the holder of each old chunk that overlaps its
new rows, preferring the rank itself.  :func:`execute` then sends those rows
point to point: a piece of at least
:data:`~agents.recovery.tensor_stream.DIRECT_BYTES` by itself, straight from
the holder's tensor into the receiver's new rows (host memory, no copy), the
smaller ones packed into one message per pair of ranks and dtype; a rank that
holds what it needs copies it locally.  The same plan serves a replacement of equal
world size (only the new rank receives) and a world-size change (rows are
redistributed from memory).

Rows are numbered in a space shared by all chunks: for ``fsdp`` and ``hsdp`` the
parameter's own dimension 0 (``torch.chunk``'s split, a ``dict`` of row counts);
for a mesh, whose slices are DTensor's local tensors, chunk after chunk of
their dimension 0 (:func:`stacked`).  Either way an :data:`Extent` says where
a chunk's rows lie.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agents.recovery.tensor_stream import DIRECT_BYTES
from agents.state.sharding import Layout, SliceKey, chunk_rows

__all__ = [
    "Extent",
    "Held",
    "Piece",
    "TransferPlan",
    "execute",
    "pieces",
    "plan",
    "stacked",
]

#: What a rank says it holds: (step, shards, index, has the replicated state).
Held = tuple[int, int, int, bool]

#: ``(fqn, layout)`` → ``[start, stop)`` of the rows that layout's chunk holds.
Extent = Callable[[str, Layout], tuple[int, int]]
#: Full row counts by name (dimension-0 chunks), or an :data:`Extent`.
Rows = Mapping[str, int] | Extent


def _extent(rows: Rows) -> Extent:
    if callable(rows):
        return rows
    return lambda fqn, layout: chunk_rows(rows[fqn], layout)


def stacked(local_rows: Mapping[tuple[str, int], int]) -> Extent:
    """An extent for slices that are whole local tensors: chunk ``i`` of a key
    follows chunk ``i - 1``; ``local_rows[(fqn, i)]`` is chunk ``i``'s dimension 0
    (a chunk missing from it has none)."""

    def extent(fqn: str, layout: Layout) -> tuple[int, int]:
        start = sum(local_rows.get((fqn, i), 0) for i in range(layout.index))
        return start, start + local_rows.get((fqn, layout.index), 0)

    return extent


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of key ``key`` (global row numbers), from old chunk ``chunk``."""

    key: SliceKey
    chunk: int
    start: int
    stop: int


@dataclass(frozen=True)
class TransferPlan:
    """Which holder serves which rows to which rank, at ``step``."""

    step: int
    old: int  # shards of the old layout
    #: ``holder[(receiver, old chunk)]`` = the rank that sends it
    holder: dict[tuple[int, int], int]
    #: the rank whose replicated state every rank takes
    replicated_from: int

    def sources(self, receiver: int) -> set[int]:
        return {h for (r, _), h in self.holder.items() if r == receiver}


def plan(held: list[list[Held]], new: list[Layout]) -> TransferPlan | None:
    """The newest complete old layout and who serves whom (None: nothing complete).

    Args:
        held: per rank, what it holds.
        new: per rank, its layout in the new generation.
    """
    steps = sorted({h[0] for hs in held for h in hs}, reverse=True)
    for step in steps:
        for shards in sorted({h[1] for hs in held for h in hs if h[0] == step}):
            holders: dict[int, list[int]] = {}
            replicated = []
            for rank, hs in enumerate(held):
                for s, n, i, rep in hs:
                    if s == step and n == shards:
                        holders.setdefault(i, []).append(rank)
                        if rep:
                            replicated.append(rank)
            if len(holders) < shards or not replicated:
                continue
            chosen: dict[tuple[int, int], int] = {}
            for receiver in range(len(new)):
                for chunk, ranks in holders.items():
                    ranks = sorted(set(ranks))
                    chosen[(receiver, chunk)] = (
                        receiver if receiver in ranks else ranks[receiver % len(ranks)]
                    )
            return TransferPlan(step, shards, chosen, min(replicated))
    return None


def pieces(rows: Rows, keys: list[SliceKey], old: int, new: Layout) -> list[Piece]:
    """Rows of each key that ``new`` needs, cut at the old chunks' borders."""
    extent = _extent(rows)
    out = []
    for key in keys:
        lo, hi = extent(key[0], new)
        for chunk in range(old):
            a, b = extent(key[0], Layout(old, chunk))
            start, stop = max(lo, a), min(hi, b)
            if start < stop:
                out.append(Piece(key, chunk, start, stop))
    return out


def execute(
    tp: TransferPlan,
    rank: int,
    new: list[Layout],
    rows: Rows,
    structure: dict[SliceKey, tuple[torch.dtype, tuple[int, ...]]],
    mine: Callable[[int], dict[SliceKey, torch.Tensor] | None],
    targets: dict[SliceKey, torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> int:
    """Fill ``targets`` (this rank's new local rows) as ``tp`` says; send what others need.

    Args:
        mine: old chunk index → this rank's tensors of that chunk at ``tp.step``
            (None when it holds none).
        targets: key → tensor of this rank's new local rows, written in place.

    Returns:
        Bytes this rank received from others.
    """
    keys = sorted(structure)
    rows = _extent(rows)
    world = len(new)
    sends: list[dist.Work] = []
    keep: list[torch.Tensor] = []
    received = 0

    def nbytes(p: Piece) -> int:
        dtype, trailing = structure[p.key]
        return (p.stop - p.start) * _row_numel(trailing) * dtype.itemsize

    for peer in range(world):
        if peer == rank:
            continue
        # what this rank sends to ``peer``: small pieces packed per dtype, then large ones
        out = [
            p for p in pieces(rows, keys, tp.old, new[peer]) if tp.holder[(peer, p.chunk)] == rank
        ]
        small = [p for p in out if nbytes(p) < DIRECT_BYTES]
        flats = [(f, _tag(f.dtype)) for f in _pack(small, tp.old, rows, mine)] if small else []
        for p in out:
            if nbytes(p) >= DIRECT_BYTES:
                flats.append((_held_rows(p, tp.old, rows, mine).contiguous().cpu(), _DIRECT_TAG))
        for flat, tag in flats:
            keep.append(flat)
            work = dist.isend(flat, dst=peer, group=group, tag=tag)
            assert work is not None
            sends.append(work)
    need = pieces(rows, keys, tp.old, new[rank])
    lo = {k: rows(k[0], new[rank])[0] for k in keys}

    def target(p: Piece) -> torch.Tensor:
        return targets[p.key][p.start - lo[p.key] : p.stop - lo[p.key]]

    recvs: list[tuple[dist.Work, torch.Tensor, list[Piece]]] = []
    for src in sorted({tp.holder[(rank, p.chunk)] for p in need}):
        got = [p for p in need if tp.holder[(rank, p.chunk)] == src]
        if src == rank:
            for p in got:
                target(p).copy_(_held_rows(p, tp.old, rows, mine))
            continue
        small = [p for p in got if nbytes(p) < DIRECT_BYTES]
        for dtype in sorted({structure[p.key][0] for p in small}, key=str):
            these = [p for p in small if structure[p.key][0] == dtype]
            numel = sum((p.stop - p.start) * _row_numel(structure[p.key][1]) for p in these)
            buf = torch.empty(numel, dtype=dtype)
            work = dist.irecv(buf, src=src, group=group, tag=_tag(dtype))
            assert work is not None
            recvs.append((work, buf, these))
        for p in got:
            if nbytes(p) < DIRECT_BYTES:
                continue
            t = target(p)
            # straight into the new rows where they are host memory, else through a copy
            landing = (
                t
                if t.device.type == "cpu" and t.is_contiguous()
                else torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format)
            )
            work = dist.irecv(landing, src=src, group=group, tag=_DIRECT_TAG)
            assert work is not None
            recvs.append((work, landing, [p]))
    for work, buf, these in recvs:
        work.wait()
        received += buf.numel() * buf.element_size()
        if len(these) == 1 and nbytes(these[0]) >= DIRECT_BYTES:
            t = target(these[0])
            if buf is not t:
                t.copy_(buf)
            continue
        offset = 0
        for p in these:
            trailing = structure[p.key][1]
            count = (p.stop - p.start) * _row_numel(trailing)
            part = buf[offset : offset + count].view(p.stop - p.start, *trailing)
            target(p).copy_(part)
            offset += count
    for work in sends:
        work.wait()
    return received


def _held_rows(
    p: Piece,
    old: int,
    rows: Extent,
    mine: Callable[[int], dict[SliceKey, torch.Tensor] | None],
) -> torch.Tensor:
    """The rows of piece ``p`` in this rank's copy of its old chunk."""
    held = mine(p.chunk)
    assert held is not None, f"chunk {p.chunk} planned from a rank that lacks it"
    a = rows(p.key[0], Layout(old, p.chunk))[0]
    return held[p.key][p.start - a : p.stop - a].detach()


def _row_numel(trailing: tuple[int, ...]) -> int:
    n = 1
    for d in trailing:
        n *= d
    return n


def _pack(
    out: list[Piece],
    old: int,
    rows: Extent,
    mine: Callable[[int], dict[SliceKey, torch.Tensor] | None],
) -> list[torch.Tensor]:
    """The pieces as one flat CPU tensor per dtype (in the receiver's order)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in out:
        t = _held_rows(p, old, rows, mine)
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1).cpu())
    return [torch.cat(by_dtype[d]) for d in sorted(by_dtype, key=str)]


#: The tag of pieces sent by themselves (packed ones are tagged by dtype, below 1000).
_DIRECT_TAG = 1000


def _tag(dtype: torch.dtype) -> int:
    return sum(str(dtype).encode()) % 1000
