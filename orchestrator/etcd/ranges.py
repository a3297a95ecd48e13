"""Range reads in pages at one revision, and trimming the oldest keys of a range.

Used by the key-value facade (:class:`~orchestrator.etcd.client.EtcdClient`),
in whichever process holds a client.  Every read of a range is paged: pages
of about :data:`PAGE_BYTES`, all read at the revision of the first, so the
result is one consistent snapshot however large it is and no answer nears the
gRPC message limits (:mod:`orchestrator.etcd.members`).  A page whose answer
is over the receive limit anyway is asked for again in halves; a revision
compacted away between two pages starts the read again.
"""

from __future__ import annotations

from typing import Any

import etcd3.utils as etcd_utils
from etcd3 import etcdrpc

from orchestrator.etcd.diagnosis import EtcdCompactedError, EtcdResponseTooLargeError
from orchestrator.etcd.kv import KeyValue, from_proto
from orchestrator.etcd.transport import EtcdTransport, stub_call

__all__ = [
    "COMPACTED_RESTARTS",
    "FIRST_PAGE_KEYS",
    "KEYS_PAGE",
    "KV_OVERHEAD_BYTES",
    "MAX_PAGE_KEYS",
    "PAGE_BYTES",
    "RangeReader",
]

#: What one page of a range read, or one batch of writes, aims to stay under.
PAGE_BYTES = 1024 * 1024
#: Keys asked for in the first page of a range read; later pages are sized from
#: the bytes per key seen so far, to about :data:`PAGE_BYTES`.
FIRST_PAGE_KEYS = 64
#: The most keys asked for in one page.
MAX_PAGE_KEYS = 4096
#: Keys per page when only keys are read (an answer of keys is small).
KEYS_PAGE = 1024
#: Bytes a key-value costs in an answer beyond its key and value (revisions, lease).
KV_OVERHEAD_BYTES = 32
#: How often a paged read starts again when the revision it reads at was
#: compacted away between two pages.
COMPACTED_RESTARTS = 3


class RangeReader:
    """Paged reads of the keys under a prefix, through ``transport``."""

    def __init__(self, transport: EtcdTransport) -> None:
        self.transport = transport

    def prefix(self, prefix: str, *, keys_only: bool = False) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (with its value unless ``keys_only``), sorted by
        key, and the revision they were read at.

        Raises:
            EtcdError: as for any call; ``EtcdResponseTooLargeError`` only when a
                single key-value is over the receive limit.
        """
        start = prefix.encode()
        end = etcd_utils.prefix_range_end(start)
        what = f" listing {prefix}*" if keys_only else f" reading {prefix}*"
        for attempt in range(COMPACTED_RESTARTS + 1):
            try:
                return self._read_pages(start, end, keys_only, what)
            except EtcdCompactedError:
                if attempt == COMPACTED_RESTARTS:
                    raise
        raise AssertionError("unreachable")

    def _read_pages(
        self, start: bytes, end: bytes, keys_only: bool, what: str
    ) -> tuple[list[KeyValue], int]:
        out: list[KeyValue] = []
        revision: int | None = None
        limit = KEYS_PAGE if keys_only else FIRST_PAGE_KEYS
        key = start
        while True:
            try:
                resp = self.page(key, end, limit, revision, keys_only, what)
            except EtcdResponseTooLargeError:
                if limit == 1:
                    raise
                limit = max(limit // 2, 1)
                continue
            if revision is None:
                revision = int(resp.header.revision)
            out.extend(from_proto(kv) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return out, revision
            key = bytes(resp.kvs[-1].key) + b"\x00"
            if not keys_only:
                size = sum(len(kv.key) + len(kv.value) + KV_OVERHEAD_BYTES for kv in resp.kvs)
                per_key = max(size / len(resp.kvs), 1.0)
                limit = max(1, min(int(PAGE_BYTES / per_key), MAX_PAGE_KEYS))

    def child_names(self, prefix: str) -> list[str]:
        """The distinct first segments of the keys under ``prefix``, sorted.

        ``child_names("/ringmaster/jobs/")`` is the job names.  Neither values
        nor every key are read: once a page names a child, the next page starts
        after every key of that child (``<prefix><name>/`` ... ``<prefix><name>0``),
        so it costs a request per child with many keys, not a read of them all.
        Every page is read at the revision of the first.
        """
        encoded = prefix.encode()
        end = etcd_utils.prefix_range_end(encoded)
        names: list[str] = []
        start = encoded
        revision: int | None = None
        while True:
            resp = self.page(start, end, KEYS_PAGE, revision, True, f" listing {prefix}*")
            if revision is None:
                revision = int(resp.header.revision)
            for kv in resp.kvs:
                name = bytes(kv.key)[len(encoded) :].split(b"/", 1)[0].decode()
                if not names or names[-1] != name:
                    names.append(name)
            if not resp.more or not resp.kvs:
                return sorted(set(names))
            # Past the last child seen: its keys all lie below "<prefix><name>0"
            # ("0" sorts right after "/").  A child whose page was cut short is
            # the last one, so no child is skipped.
            last = bytes(resp.kvs[-1].key)[len(encoded) :]
            child, slash, _ = last.partition(b"/")
            start = encoded + child + (b"0" if slash else b"\x00")

    def count(self, prefix: str) -> int:
        """How many keys live under ``prefix`` (counted by etcd, values not sent)."""
        resp = self.transport.call(lambda c: c.get_prefix_response(prefix, count_only=True))
        return int(resp.count)

    def keep_newest(self, prefix: str, keep: int, slack: int = 0) -> int:
        """Delete the first keys under ``prefix`` (in key order) so that ``keep`` remain.

        See :meth:`~orchestrator.etcd.client.EtcdClient.keep_newest`; returns how
        many keys were deleted.
        """
        surplus = self.count(prefix) - keep
        if surplus <= slack:
            return 0
        encoded = prefix.encode()
        deleted = 0
        while surplus > 0:
            resp = self.page(
                encoded,
                etcd_utils.prefix_range_end(encoded),
                min(surplus, KEYS_PAGE),
                None,
                True,
                f" listing {prefix}*",
            )
            if not resp.kvs:
                break
            last = bytes(resp.kvs[-1].key) + b"\x00"
            request = etcdrpc.DeleteRangeRequest(key=encoded, range_end=last)
            done = self.transport.call(
                stub_call("DeleteRange", request), what=f" trimming {prefix}*"
            )
            deleted += int(done.deleted)
            surplus -= len(resp.kvs)
        return deleted

    def page(
        self,
        start: bytes,
        end: bytes,
        limit: int,
        revision: int | None,
        keys_only: bool,
        what: str,
    ) -> Any:
        """One page: at most ``limit`` keys of ``[start, end)`` at ``revision`` (None: now)."""

        def page(c: Any) -> Any:
            return c.get_range_response(
                start,
                end,
                sort_order="ascend",
                limit=limit,
                revision=revision,
                keys_only=keys_only,
            )

        return self.transport.call(page, what=what)
