"""Transactions: compare-and-set, fenced writes, and many keys read or written at once.

Used by the key-value facade (:class:`~orchestrator.etcd.client.EtcdClient`),
in whichever process holds a client.  Compare-and-set on ``mod_revision`` is
the primitive rendezvous, leader election and fencing are built from; the
c10d store adds compare-and-set on a value and multi-key reads and writes.
Many keys are read or written in transactions of up to :data:`MAX_TXN_OPS`
keys and about :data:`~orchestrator.etcd.ranges.PAGE_BYTES`; the reads all at
the revision of the first, so they are one snapshot.  A write over etcd's
request limit is refused before it is sent, naming the key
(:func:`check_request_size`).
"""

from __future__ import annotations

from typing import Any

from etcd3 import etcdrpc

from orchestrator.etcd.diagnosis import (
    EtcdCompactedError,
    EtcdNoSpaceError,
    EtcdRequestTooLargeError,
    EtcdResponseTooLargeError,
)
from orchestrator.etcd.kv import KeyValue, from_proto, key_value
from orchestrator.etcd.members import MAX_REQUEST_BYTES
from orchestrator.etcd.ranges import COMPACTED_RESTARTS, KV_OVERHEAD_BYTES, PAGE_BYTES
from orchestrator.etcd.transport import EtcdTransport, stub_call

__all__ = [
    "MAX_TXN_OPS",
    "REQUEST_OVERHEAD_BYTES",
    "Transactions",
    "check_request_size",
    "write_batches",
]

#: Operations per transaction (etcd's default ``--max-txn-ops``).
MAX_TXN_OPS = 128
#: Room left in a write for what etcd adds around the key and value: a put of
#: key and value larger than ``MAX_REQUEST_BYTES`` minus this is refused here.
REQUEST_OVERHEAD_BYTES = 1024


class Transactions:
    """The transactions of the facade, through ``transport``.

    Leases are given by id (None: no lease).
    """

    def __init__(self, transport: EtcdTransport) -> None:
        self.transport = transport

    def compare_and_set(
        self, key: str, data: bytes, expected_mod_revision: int | None, lease_id: int | None
    ) -> tuple[bool, KeyValue | None]:
        """See :meth:`~orchestrator.etcd.client.EtcdClient.compare_and_set`."""
        check_request_size(key, data)

        def txn(c: Any) -> Any:
            if expected_mod_revision is None:
                compare = [c.transactions.create(key) == 0]
            else:
                compare = [c.transactions.mod(key) == expected_mod_revision]
            return c.transaction(
                compare=compare,
                success=[c.transactions.put(key, data, lease=lease_id), c.transactions.get(key)],
                failure=[c.transactions.get(key)],
            )

        ok, responses = self.transport.call(txn, write=True, what=f" writing {key}")
        got = responses[-1]
        current = key_value(key, got[0][0], got[0][1]) if got else None
        return bool(ok), current

    def compare_value_and_set(
        self, key: str, expected_value: bytes, data: bytes, lease_id: int | None
    ) -> tuple[bool, KeyValue | None]:
        """See :meth:`~orchestrator.etcd.client.EtcdClient.compare_value_and_set`."""
        check_request_size(key, data, len(expected_value))

        def txn(c: Any) -> Any:
            return c.transaction(
                compare=[c.transactions.value(key) == expected_value],
                success=[c.transactions.put(key, data, lease=lease_id), c.transactions.get(key)],
                failure=[c.transactions.get(key)],
            )

        ok, responses = self.transport.call(txn, write=True, what=f" writing {key}")
        got = responses[-1]
        current = key_value(key, got[0][0], got[0][1]) if got else None
        return bool(ok), current

    def put_guarded(
        self,
        key: str,
        data: bytes,
        guard_key: str,
        guard_mod_revision: int,
        lease_id: int | None,
    ) -> tuple[bool, KeyValue | None]:
        """See :meth:`~orchestrator.etcd.client.EtcdClient.put_guarded`."""
        check_request_size(key, data, len(guard_key))

        def txn(c: Any) -> Any:
            return c.transaction(
                compare=[c.transactions.mod(guard_key) == guard_mod_revision],
                success=[c.transactions.put(key, data, lease=lease_id)],
                failure=[c.transactions.get(guard_key)],
            )

        ok, responses = self.transport.call(txn, write=True, what=f" writing {key}")
        if ok:
            return True, None
        got = responses[-1]
        return False, (key_value(guard_key, got[0][0], got[0][1]) if got else None)

    def get_many(self, keys: list[str]) -> dict[str, KeyValue]:
        """See :meth:`~orchestrator.etcd.client.EtcdClient.get_many`."""
        for attempt in range(COMPACTED_RESTARTS + 1):
            try:
                return self._get_many_at_one_revision(keys)
            except EtcdCompactedError:
                if attempt == COMPACTED_RESTARTS:
                    raise
        raise AssertionError("unreachable")

    def _get_many_at_one_revision(self, keys: list[str]) -> dict[str, KeyValue]:
        found: dict[str, KeyValue] = {}
        revision: int | None = None
        pending = [keys[i : i + MAX_TXN_OPS] for i in range(0, len(keys), MAX_TXN_OPS)]
        while pending:
            batch = pending.pop(0)
            ops = [
                etcdrpc.RequestOp(
                    request_range=etcdrpc.RangeRequest(key=k.encode(), revision=revision or 0)
                )
                for k in batch
            ]
            request = etcdrpc.TxnRequest(compare=[], success=ops, failure=[])
            try:
                resp = self.transport.call(
                    stub_call("Txn", request), what=f" reading {len(batch)} keys from {batch[0]}"
                )
            except EtcdNoSpaceError:
                # Over its quota etcd refuses every transaction, reads too (plain
                # reads it serves): read the keys one by one instead.
                revision = self._get_each(batch, revision, found)
                continue
            except EtcdResponseTooLargeError:
                if len(batch) == 1:
                    raise
                half = len(batch) // 2
                pending[:0] = [batch[:half], batch[half:]]
                continue
            if revision is None:
                revision = int(resp.header.revision)
            for key, answer in zip(batch, resp.responses, strict=True):
                for kv in answer.response_range.kvs:
                    found[key] = from_proto(kv, key)
        return found

    def _get_each(
        self, batch: list[str], revision: int | None, found: dict[str, KeyValue]
    ) -> int | None:
        """Read ``batch`` a key at a time at ``revision`` into ``found``; returns the revision."""
        for key in batch:

            def one(c: Any, key: str = key, at: int | None = revision) -> Any:
                return c.get_response(key, revision=at)

            resp = self.transport.call(one, what=f" reading {key}")
            if revision is None:
                revision = int(resp.header.revision)
            for kv in resp.kvs:
                found[key] = from_proto(kv, key)
        return revision

    def put_many(self, items: list[tuple[str, bytes]], lease_id: int | None) -> None:
        """See :meth:`~orchestrator.etcd.client.EtcdClient.put_many`."""
        for key, value in items:
            check_request_size(key, value)
        for batch in write_batches(items):

            def txn(c: Any, batch: list[tuple[str, bytes]] = batch) -> Any:
                ops = [c.transactions.put(k, v, lease=lease_id) for k, v in batch]
                return c.transaction(compare=[], success=ops, failure=[])

            self.transport.call(
                txn, write=True, what=f" writing {len(batch)} keys from {batch[0][0]}"
            )


def check_request_size(key: str, value: bytes, extra: int = 0) -> None:
    """Refuse, before sending it, a write that etcd would refuse as too large.

    Args:
        key / value: what is written.
        extra: other bytes the request carries (a compared value, a guard key).

    Raises:
        EtcdRequestTooLargeError: naming the key, its size and the limit.
    """
    size = len(key.encode()) + len(value) + extra
    if size + REQUEST_OVERHEAD_BYTES > MAX_REQUEST_BYTES:
        raise EtcdRequestTooLargeError(
            f"refusing to write {key}: {size} bytes is over etcd's request limit "
            f"({MAX_REQUEST_BYTES} bytes, --max-request-bytes, less "
            f"{REQUEST_OVERHEAD_BYTES} for the request around it); store less under one key"
        )


def write_batches(items: list[tuple[str, bytes]]) -> list[list[tuple[str, bytes]]]:
    """``items`` in batches of at most :data:`MAX_TXN_OPS` and about
    :data:`~orchestrator.etcd.ranges.PAGE_BYTES` (a larger key-value is a batch of its own)."""
    out: list[list[tuple[str, bytes]]] = []
    batch: list[tuple[str, bytes]] = []
    size = 0
    for key, value in items:
        cost = len(key) + len(value) + KV_OVERHEAD_BYTES
        if batch and (len(batch) == MAX_TXN_OPS or size + cost > PAGE_BYTES):
            out.append(batch)
            batch, size = [], 0
        batch.append((key, value))
        size += cost
    if batch:
        out.append(batch)
    return out
