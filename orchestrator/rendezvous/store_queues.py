"""The queues of the c10d store on etcd: ``queue_push``, ``queue_pop``, ``queue_len``.

In whichever process holds an :class:`~orchestrator.rendezvous.store.EtcdStore`
(a torch elastic agent, a training process bootstrapping on it).

torch's stores keep queues apart from keys: a queue is neither counted by
``num_keys`` nor listed by ``list_keys``, and ``check``/``wait`` take a name
as there when a key *or a non-empty queue* of that name exists.  So the
queues of a store with prefix ``P/`` live beside it, not under it: queue
``Q`` under ``P#queues/<Q>/`` (``%``, ``/`` and ``#`` in ``Q`` escaped as
``%25``, ``%2F`` and ``%23``, so that no queue's items or receipts fall under
another queue's prefix).

* **push**: one put of an item key with a fresh random name.  Its create
  revision is its place in the queue: etcd orders all writes of the cluster,
  so concurrent pushers are ordered by when etcd committed them.  A put that
  the client sends again after a lost answer writes the same key again: an
  item is never doubled.
* **pop**: read the oldest items (sorted by create revision), then delete the
  first that is still there in a transaction that compares its
  ``mod_revision``: of concurrent pops, exactly one deletes a given item, the
  others go on to the next.  The same transaction writes a receipt under a
  key of that pop's own (``P#queues/<Q>#taken/<token>``, the token unique to
  the pop): a pop whose answer was lost and that the client sent again finds
  its receipt and knows that the item is its own, so an item is not lost
  either, whatever other pops did meanwhile.  The receipt is removed by the
  next pop of the same store's queues, in its own transaction (no extra
  round trip): at most one receipt per store stays behind.
* **blocking pop**: when the queue is empty, watch it from the revision the
  read was made at, so a push is never missed and nobody polls.

torch 2.13 forwards no queue call from C++ to a store written in Python (a
``PrefixStore`` around the store raises ``NotImplementedError``): queues are
reached by calling them on the store itself.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import etcd3.exceptions as etcd_exc
from etcd3 import etcdrpc
from etcd3.utils import prefix_range_end

from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.kv import KeyValue, Lease, from_proto
from orchestrator.etcd.transport import stub_call

__all__ = ["CANDIDATES", "LeasedWrite", "StoreQueues", "queue_root"]

T = TypeVar("T")

#: How many of the oldest items a pop reads at once: the ones it tries in turn
#: when concurrent pops take the first ones.
CANDIDATES = 8


class LeasedWrite(Protocol):
    """Runs a write with the store's lease, or None (:meth:`RunLease.write
    <orchestrator.rendezvous.store.RunLease.write>`)."""

    def __call__(self, fn: Callable[[Lease | None], T]) -> T: ...


def queue_root(prefix: str) -> str:
    """Where the queues of the store with ``prefix`` (ending in ``/``) live: beside its keys."""
    return prefix.rstrip("/") + "#queues/"


def _escaped(name: str) -> str:
    return name.replace("%", "%25").replace("/", "%2F").replace("#", "%23")


class StoreQueues:
    """The queues of one store.

    Args:
        client: the etcd client.
        root: :func:`queue_root` of the store's prefix.
        write: runs a write with the store's lease.
    """

    def __init__(self, client: EtcdClient, root: str, write: LeasedWrite) -> None:
        self._client = client
        self.root = root
        self._write = write
        #: the receipt of this store's last pop, removed by its next one
        self._last_receipt: bytes | None = None

    def items(self, name: str) -> str:
        """The prefix of queue ``name``'s items."""
        return f"{self.root}{_escaped(name)}/"

    def receipt(self, name: str, token: bytes) -> str:
        """The key a pop of queue ``name`` with ``token`` leaves (beside its items)."""
        return f"{self.root}{_escaped(name)}#taken/{token.decode()}"

    # -- the operations ----------------------------------------------------------------

    def push(self, name: str, data: bytes) -> None:
        """Append ``data`` to queue ``name``."""
        key = self.items(name) + uuid.uuid4().hex
        self._write(lambda lease: self._client.put(key, data, lease=lease))

    def length(self, name: str) -> int:
        """How many items queue ``name`` holds now."""
        return self._client.count_prefix(self.items(name))

    def nonempty(self, name: str, revision: int | None = None) -> bool:
        """Whether queue ``name`` holds an item (now, or at ``revision``)."""
        prefix = self.items(name)
        request = etcdrpc.RangeRequest(
            key=prefix.encode(),
            range_end=prefix_range_end(prefix.encode()),
            count_only=True,
            revision=revision or 0,
        )
        resp = self._client.transport.call(stub_call("Range", request), what=f" reading {prefix}")
        return int(resp.count) > 0

    def pop(self, name: str, block: bool, timeout: timedelta) -> bytes | None:
        """Take the oldest item of queue ``name``.

        Returns:
            The item; None when the queue was empty (``block=False``) or stayed
            empty for ``timeout`` (``block=True``).
        """
        deadline = time.monotonic() + max(timeout.total_seconds(), 0.0)
        prefix = self.items(name)
        while True:
            oldest, revision = self._oldest(prefix)
            for kv in oldest:
                if self.take(name, kv, uuid.uuid4().hex.encode()):
                    return kv.value
            if oldest:
                continue  # concurrent pops took them all: read again
            remaining = deadline - time.monotonic()
            if not block or remaining <= 0:
                return None
            self.watch([(prefix, prefix_range_end(prefix.encode()))], revision, remaining)

    # -- the parts ---------------------------------------------------------------------

    def _oldest(self, prefix: str) -> tuple[list[KeyValue], int]:
        """The oldest :data:`CANDIDATES` items under ``prefix``, and the revision read at."""
        request = etcdrpc.RangeRequest(
            key=prefix.encode(),
            range_end=prefix_range_end(prefix.encode()),
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.CREATE,
            limit=CANDIDATES,
        )
        resp = self._client.transport.call(stub_call("Range", request), what=f" reading {prefix}")
        return [from_proto(kv) for kv in resp.kvs], int(resp.header.revision)

    def take(self, name: str, item: KeyValue, token: bytes) -> bool:
        """Delete ``item`` of queue ``name`` if it is still there; True when the pop
        that ``token`` (unique to it) names deleted it, in this call or in an
        earlier one whose answer was lost."""
        receipt = self.receipt(name, token).encode()
        previous = self._last_receipt

        def txn(lease: Lease | None) -> Any:
            clear = (
                []
                if previous is None or previous == receipt
                else [
                    etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=previous))
                ]
            )
            request = etcdrpc.TxnRequest(
                compare=[
                    etcdrpc.Compare(
                        key=item.key.encode(),
                        result=etcdrpc.Compare.EQUAL,
                        target=etcdrpc.Compare.MOD,
                        mod_revision=item.mod_revision,
                    )
                ],
                success=[
                    etcdrpc.RequestOp(
                        request_delete_range=etcdrpc.DeleteRangeRequest(key=item.key.encode())
                    ),
                    etcdrpc.RequestOp(
                        request_put=etcdrpc.PutRequest(
                            key=receipt, value=b"", lease=lease.id if lease is not None else 0
                        )
                    ),
                    *clear,
                ],
                failure=[
                    etcdrpc.RequestOp(
                        request_range=etcdrpc.RangeRequest(key=receipt, count_only=True)
                    )
                ],
            )
            return self._client.transport.call(
                stub_call("Txn", request), write=True, what=f" popping {item.key}"
            )

        resp = self._write(txn)
        # Taken now; or gone, taken by this pop in an attempt whose answer was lost
        # (its receipt is there) or by another pop (none is).
        mine = bool(resp.succeeded) or int(resp.responses[0].response_range.count) > 0
        if mine:
            self._last_receipt = receipt
        return mine

    def watch(
        self, ranges: list[tuple[str, bytes | None]], after_revision: int, seconds: float
    ) -> None:
        """Block until a put in one of ``ranges`` (key, range end or None) after
        ``after_revision``, or for ``seconds``; the caller reads again either way."""
        wait = max(seconds, 0.0)

        def watch(c: Any) -> Any:
            arrived: queue.Queue[Any] = queue.Queue()
            ids: list[Any] = []
            try:
                for key, end in ranges:
                    ids.append(
                        c.add_watch_callback(
                            key,
                            arrived.put,
                            range_end=end,
                            start_revision=after_revision + 1,
                            filters=[etcdrpc.WatchCreateRequest.NODELETE],
                        )
                    )
                return arrived.get(timeout=wait)
            except (queue.Empty, etcd_exc.WatchTimedOut):
                return None
            finally:
                for watch_id in ids:
                    c.cancel_watch(watch_id)

        self._client.transport.call(
            watch, timeout=timedelta(seconds=wait) + self._client.options.op_timeout, quorum=False
        )
