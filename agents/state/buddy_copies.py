"""Redundancy for ``fsdp``: each rank's slice also lives in a buddy's host memory.

Every ``every_steps`` completed steps each rank copies its slice (parameters,
optimizer state, and the small replicated state) to host memory, keeps that
snapshot, and a background thread sends it to its *buddy*, the same local
rank on the next node (``rank + nproc_per_node``), while receiving its
*ward*'s (``rank - nproc_per_node``) from it (with an FSDP2 model in each
site under a delayed sync, on the next node of its site).  The training thread only pays
for the host copy, and waits only when the previous exchange is still under
way at the next one (so every rank runs the same exchanges in the same
order).  The exchange runs on a gloo group of its own, formed with the
generation.

When a node dies, its ranks' slices survive in their buddies' memory, and
every survivor still has its own snapshot of the same step: the new
generation is rebuilt at that step (:mod:`agents.recovery.shard_recovery`), so at most
``every_steps`` completed steps are trained again.  Each rank keeps its last
two snapshots, so a copy that was in flight when the node died still leaves
a complete set one exchange earlier.  Host memory per rank: two snapshots of
its own slice and one copy of its ward's.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from agents.state.sharding import Layout, Slice, SliceKey, chunk_rows
from orchestrator.spec.job import DEFAULT_REDUNDANCY_EVERY_STEPS

__all__ = ["DEFAULT_EVERY_STEPS", "STOP_WAIT_S", "BuddyCopies"]

log = logging.getLogger("ringmaster.worker")

#: ``sharding="fsdp"``: copy slices to the buddy every this many steps unless the job
#: file (``fault_tolerance.redundancy.every_steps``) or ``wrap()`` says otherwise.
#: Measured on a 2-core machine (benchmarks/recovery.py --sharded, 3 ranks, a 7-8 ms
#: step; docs/sharded-models.md): copies every step cost +22-25 % of the step time
#: on a quiet machine (0.4-0.6 ms of it blocks the training thread, the rest is the
#: exchange competing for the cores), every 10 steps is within the noise (-3 % to
#: +4 %), for at most 10 steps trained again after a node loss.
DEFAULT_EVERY_STEPS = DEFAULT_REDUNDANCY_EVERY_STEPS

#: How long the end of a generation waits for an exchange under way (its peers may be
#: alive but no longer exchanging); after that the thread is left to fail with the group.
STOP_WAIT_S = 5.0


class BuddyCopies:
    """This rank's own snapshots and its ward's copy, and the thread that moves them."""

    def __init__(self, every_steps: int) -> None:
        if every_steps < 1:
            raise ValueError(f"redundancy every_steps must be at least 1, got {every_steps}")
        self.every_steps = every_steps
        self._snapshots: collections.deque[Slice] = collections.deque(maxlen=2)
        self._held: Slice | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue[Slice | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._group: dist.ProcessGroup | None = None
        self._peers: tuple[int, int] | None = None
        self._rows: dict[str, int] = {}
        self._ward_layout: Layout | None = None
        #: seconds the training thread spent on the last snapshot (copy + wait)
        self.last_blocked_s = 0.0
        #: seconds the last exchange took on the thread
        self.last_exchange_s = 0.0
        #: this generation's totals, logged when it ends: copies, seconds the training
        #: thread was blocked (waiting on the previous exchange + copying), seconds of it
        #: spent copying, exchanges and their seconds on the thread
        self._totals = [0, 0.0, 0.0, 0, 0.0]

    # -- per generation ----------------------------------------------------------------

    def start(
        self,
        rank: int,
        world_size: int,
        nproc: int,
        layouts: list[Layout],
        rows: dict[str, int],
        timeout: timedelta,
        ring: Sequence[int] | None = None,
    ) -> None:
        """Form the exchange group (collective: every rank calls) and start the thread.

        Args:
            layouts: every rank's layout, by global rank.
            ring: the ranks among which buddies pair, ascending (default: every rank;
                an FSDP2 model in each site under a delayed sync: the site's).
        """
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        ring = list(ring) if ring is not None else list(range(world_size))
        at = ring.index(rank)
        buddy, ward = ring[(at + nproc) % len(ring)], ring[(at - nproc) % len(ring)]
        self._rows = rows
        if buddy == rank:
            log.warning("redundancy: one node only, no buddy on another node; no copies kept")
            self._peers = None
            return
        self._peers = (buddy, ward)
        self._ward_layout = layouts[ward]
        self._stop.clear()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="ringmaster-buddy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the exchange under way (its peer may be gone) and the thread; keep the copies."""
        self._stop.set()
        copies, blocked, copying, exchanges, exchanging = self._totals
        if copies:
            log.info(
                "redundancy: %d copies, the training thread blocked %.2f ms per copy "
                "(%.2f ms copying to host), %d exchanges of %.2f ms each on their thread",
                copies,
                1e3 * blocked / copies,
                1e3 * copying / copies,
                exchanges,
                1e3 * exchanging / max(1, exchanges),
            )
        self._totals = [0, 0.0, 0.0, 0, 0.0]
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(STOP_WAIT_S)
            if thread.is_alive():
                log.warning("redundancy: an exchange still waits on a peer; leaving it behind")
        while not self._queue.empty():
            self._queue.get_nowait()
        self._idle.set()
        self._group = None

    # -- the training thread -----------------------------------------------------------

    def after_step(self, step: int, capture: Callable[[], Slice]) -> None:
        """Snapshot this rank's slice at ``step`` (when due) and queue it for the buddy."""
        thread = self._thread
        if step % self.every_steps or thread is None:
            return
        started = time.perf_counter()
        while not self._idle.wait(0.05):
            if not thread.is_alive():
                return
        if not thread.is_alive():  # the last exchange failed: a peer is gone
            return
        copying = time.perf_counter()
        snapshot = capture().copy_to_host()
        with self._lock:
            self._snapshots.append(snapshot)
        self._idle.clear()
        self._queue.put(snapshot)
        now = time.perf_counter()
        self.last_blocked_s = now - started
        self._totals[0] += 1
        self._totals[1] += self.last_blocked_s
        self._totals[2] += now - copying

    def forget_after(self, step: int) -> None:
        """Drop snapshots and copies of steps after ``step``: the job went back to
        ``step``, and what was trained after it belongs to an abandoned timeline."""
        with self._lock:
            kept = [sl for sl in self._snapshots if sl.step <= step]
            self._snapshots.clear()
            self._snapshots.extend(kept)
            if self._held is not None and self._held.step > step:
                self._held = None

    def own_snapshots(self) -> list[Slice]:
        with self._lock:
            return list(self._snapshots)

    def held_copy(self) -> Slice | None:
        """The ward's newest complete copy, if any."""
        with self._lock:
            return self._held

    # -- the exchange thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            snapshot = self._queue.get()
            if snapshot is None or self._stop.is_set():
                return
            started = time.perf_counter()
            try:
                self._exchange(snapshot)
            except Exception as e:  # a peer is gone: the training thread finds out too
                log.info("redundancy: exchange of step %d ended: %s", snapshot.step, e)
                return
            finally:
                self._idle.set()
            self.last_exchange_s = time.perf_counter() - started
            self._totals[3] += 1
            self._totals[4] += self.last_exchange_s

    def _exchange(self, mine: Slice) -> Slice | None:
        """Send this rank's snapshot to the buddy and take the ward's, all at once.

        Every send and receive is posted before any is waited on, so a dead ward
        never keeps this rank's copy from its buddy.  The ward's copy is kept
        when all of its parts arrived, even if sending to a dead buddy failed.
        """
        assert self._peers is not None and self._ward_layout is not None
        buddy, ward = self._peers
        keys = sorted(mine.tensors)
        structure = mine.structure()
        ward_rows = {k: chunk_rows(self._rows[k[0]], self._ward_layout) for k in keys}
        header = torch.tensor([mine.step, len(keys)], dtype=torch.int64)
        incoming = torch.zeros(2, dtype=torch.int64)
        sends = [dist.isend(header, dst=buddy, group=self._group, tag=1)]
        recvs = [dist.irecv(incoming, src=ward, group=self._group, tag=1)]
        parts = []
        for i, dtype in enumerate(sorted({structure[k][0] for k in keys}, key=str)):
            these = [k for k in keys if structure[k][0] == dtype]
            out = torch.cat([mine.tensors[k].reshape(-1) for k in these])
            sizes = [
                (ward_rows[k][1] - ward_rows[k][0]) * _row_numel(structure[k][1]) for k in these
            ]
            buf = torch.empty(sum(sizes), dtype=dtype)
            sends.append(dist.isend(out, dst=buddy, group=self._group, tag=10 + i))
            recvs.append(dist.irecv(buf, src=ward, group=self._group, tag=10 + i))
            parts.append((these, sizes, buf))
        received_error = self._wait(recvs)
        sent_error = self._wait(sends)
        if received_error is not None:
            raise received_error
        step, count = (int(v) for v in incoming.tolist())
        if count != len(keys):
            log.warning(
                "redundancy: the ward's slice has %d entries, this rank's %d; not kept",
                count,
                len(keys),
            )
            return None
        tensors: dict[SliceKey, torch.Tensor] = {}
        for these, sizes, buf in parts:
            offset = 0
            for k, size in zip(these, sizes, strict=True):
                rows = ward_rows[k][1] - ward_rows[k][0]
                tensors[k] = buf[offset : offset + size].view(rows, *structure[k][1])
                offset += size
        with self._lock:
            self._held = Slice(step, self._ward_layout, tensors)
        if sent_error is not None:
            raise sent_error
        return self._held

    def _wait(self, works: list[dist.Work | None]) -> Exception | None:
        """Wait for every work; the first error, if any (the rest are waited on too).

        gloo's point-to-point work reports completion only from ``wait()``; a dead
        peer makes it raise at once, a silent one at the group's timeout.
        """
        first: Exception | None = None
        for w in works:
            assert w is not None
            try:
                w.wait()
            except Exception as e:
                first = first or e
        return first


def _row_numel(trailing: tuple[int, ...]) -> int:
    n = 1
    for d in trailing:
        n *= d
    return n
