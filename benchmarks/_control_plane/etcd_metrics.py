"""What etcd says about itself: its Prometheus endpoint, scraped and compared over time.

Every member serves Prometheus text at ``http://<client-url>/metrics``.  A
:class:`Scrape` holds one reading of every member; :func:`rates` turns two
readings into per-second figures (writes, bytes, requests by gRPC method) and
:func:`sizes` reads the database size.  Counters that every member keeps for
its own clients (bytes, gRPC calls) are summed over the members; what raft
does once for the cluster (proposals) is read from the leader.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

#: How long one scrape of one member may take.
SCRAPE_TIMEOUT_S = 10.0

_LINE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

#: The metrics kept from each scrape (the endpoint serves ~150 kB of text).
KEPT = (
    "etcd_server_proposals_committed_total",
    "etcd_server_is_leader",
    "etcd_mvcc_put_total",
    "etcd_mvcc_delete_total",
    "etcd_mvcc_txn_total",
    "etcd_mvcc_range_total",
    "etcd_debugging_mvcc_total_put_size_in_bytes",
    "etcd_debugging_mvcc_keys_total",
    "etcd_debugging_mvcc_watcher_total",
    "etcd_debugging_mvcc_slow_watcher_total",
    "etcd_debugging_mvcc_compact_revision",
    "etcd_debugging_mvcc_current_revision",
    "etcd_debugging_server_lease_expired_total",
    "etcd_mvcc_db_total_size_in_bytes",
    "etcd_mvcc_db_total_size_in_use_in_bytes",
    "etcd_network_client_grpc_received_bytes_total",
    "etcd_network_client_grpc_sent_bytes_total",
    "etcd_disk_wal_write_bytes_total",
    "etcd_disk_wal_fsync_duration_seconds_sum",
    "etcd_disk_wal_fsync_duration_seconds_count",
    "etcd_disk_backend_commit_duration_seconds_sum",
    "etcd_disk_backend_commit_duration_seconds_count",
    "grpc_server_handled_total",
    "grpc_server_msg_received_total",
    "process_cpu_seconds_total",
)

Labels = tuple[tuple[str, str], ...]


@dataclass
class MemberScrape:
    """One member's kept metrics: ``name -> {labels: value}``."""

    values: dict[str, dict[Labels, float]] = field(default_factory=dict)

    def total(self, name: str, **match: str) -> float:
        """Sum of ``name`` over the series whose labels include ``match``."""
        out = 0.0
        for labels, value in self.values.get(name, {}).items():
            have = dict(labels)
            if all(have.get(k) == v for k, v in match.items()):
                out += value
        return out

    def by_label(self, name: str, label: str, **match: str) -> dict[str, float]:
        """``name`` summed per value of ``label`` (over the series matching ``match``)."""
        out: dict[str, float] = {}
        for labels, value in self.values.get(name, {}).items():
            have = dict(labels)
            if all(have.get(k) == v for k, v in match.items()) and label in have:
                out[have[label]] = out.get(have[label], 0.0) + value
        return out


@dataclass
class Scrape:
    """Every member's metrics at one moment (``at``: monotonic seconds)."""

    at: float
    members: list[MemberScrape]

    @property
    def leader(self) -> MemberScrape:
        for m in self.members:
            if m.total("etcd_server_is_leader") >= 1:
                return m
        return self.members[0]

    def summed(self, name: str, **match: str) -> float:
        return sum(m.total(name, **match) for m in self.members)


def parse(text: str) -> MemberScrape:
    """The :data:`KEPT` metrics of one Prometheus text exposition."""
    out = MemberScrape()
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE_RE.match(line)
        if m is None or m.group(1) not in KEPT:
            continue
        labels = tuple(sorted(_LABEL_RE.findall(m.group(3) or "")))
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.values.setdefault(m.group(1), {})[labels] = value
    return out


def scrape(urls: Sequence[str]) -> Scrape:
    """Read ``<url>/metrics`` of every member.

    Raises:
        OSError: a member did not answer within :data:`SCRAPE_TIMEOUT_S`.
    """
    members = []
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
            members.append(parse(r.read().decode()))
    return Scrape(time.monotonic(), members)


#: gRPC methods worth a column: what a node, a worker and the controller call.
METHODS = (
    "Put",
    "Range",
    "Txn",
    "DeleteRange",
    "LeaseGrant",
    "LeaseRevoke",
    "LeaseKeepAlive",
    "Watch",
)


def rates(a: Scrape, b: Scrape) -> dict[str, float]:
    """Per-second figures between two scrapes (``b`` later than ``a``)."""
    dt = max(b.at - a.at, 1e-9)

    def leader(name: str) -> float:
        return (b.leader.total(name) - a.leader.total(name)) / dt

    def summed(name: str, **match: str) -> float:
        return (b.summed(name, **match) - a.summed(name, **match)) / dt

    out = {
        # every write, lease grant/revoke and compaction is one raft proposal
        "proposals_per_s": leader("etcd_server_proposals_committed_total"),
        "puts_per_s": leader("etcd_mvcc_put_total"),
        "deletes_per_s": leader("etcd_mvcc_delete_total"),
        "txns_per_s": leader("etcd_mvcc_txn_total"),
        "ranges_per_s": summed("etcd_mvcc_range_total"),
        "put_bytes_per_s": leader("etcd_debugging_mvcc_total_put_size_in_bytes"),
        "client_bytes_in_per_s": summed("etcd_network_client_grpc_received_bytes_total"),
        "client_bytes_out_per_s": summed("etcd_network_client_grpc_sent_bytes_total"),
        "wal_bytes_per_s": leader("etcd_disk_wal_write_bytes_total"),
        "etcd_cpu_cores": summed("process_cpu_seconds_total"),
    }
    for method in METHODS:
        # streams (Watch, LeaseKeepAlive) count messages received, unary calls count calls
        name = "grpc_server_msg_received_total"
        out[f"grpc_{method}_per_s"] = summed(name, grpc_method=method)
    fsyncs = b.leader.total("etcd_disk_wal_fsync_duration_seconds_count") - a.leader.total(
        "etcd_disk_wal_fsync_duration_seconds_count"
    )
    fsync_s = b.leader.total("etcd_disk_wal_fsync_duration_seconds_sum") - a.leader.total(
        "etcd_disk_wal_fsync_duration_seconds_sum"
    )
    out["wal_fsync_ms_mean"] = 1000 * fsync_s / fsyncs if fsyncs else 0.0
    commits = b.leader.total("etcd_disk_backend_commit_duration_seconds_count") - a.leader.total(
        "etcd_disk_backend_commit_duration_seconds_count"
    )
    commit_s = b.leader.total("etcd_disk_backend_commit_duration_seconds_sum") - a.leader.total(
        "etcd_disk_backend_commit_duration_seconds_sum"
    )
    out["backend_commit_ms_mean"] = 1000 * commit_s / commits if commits else 0.0
    return out


def sizes(s: Scrape) -> dict[str, float]:
    """Database size (largest member), keys, watchers and compaction state at one scrape."""
    return {
        "db_total_bytes": max(m.total("etcd_mvcc_db_total_size_in_bytes") for m in s.members),
        "db_in_use_bytes": max(
            m.total("etcd_mvcc_db_total_size_in_use_in_bytes") for m in s.members
        ),
        "keys": s.leader.total("etcd_debugging_mvcc_keys_total"),
        "watchers": s.summed("etcd_debugging_mvcc_watcher_total"),
        "slow_watchers": s.summed("etcd_debugging_mvcc_slow_watcher_total"),
        "compact_revision": s.leader.total("etcd_debugging_mvcc_compact_revision"),
        "current_revision": s.leader.total("etcd_debugging_mvcc_current_revision"),
        "leases_expired": s.leader.total("etcd_debugging_server_lease_expired_total"),
    }
