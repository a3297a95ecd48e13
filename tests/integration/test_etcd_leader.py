"""Leader election on the one lease keep-alive loop (Lease.keep_alive).

Against the real etcd of the test fixtures: a leader keeps leading while its
lease is refreshed, stops leading once etcd says the lease is gone, and a
standby then takes over; resigning hands over at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from orchestrator.controller.leader import LeaderElection
from orchestrator.etcd.client import EtcdClient

pytestmark = pytest.mark.integration

TTL = timedelta(seconds=2)


def _until(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Whether ``condition`` holds within ``timeout`` (asked every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.05)
    return True


def _lease_of(client: EtcdClient, key: str) -> int:
    kv = client.get(key)
    assert kv is not None and kv.lease_id
    return kv.lease_id


def test_the_leader_lease_is_kept_alive_past_its_ttl(
    etcd_client: EtcdClient, key_prefix: str
) -> None:
    leader = LeaderElection(etcd_client, "a", TTL, key=key_prefix + "leader")
    standby = LeaderElection(etcd_client, "b", TTL, key=key_prefix + "leader")
    assert leader.try_acquire()
    assert not standby.try_acquire()
    lease_id = _lease_of(etcd_client, key_prefix + "leader")
    # three TTLs later it still leads: the keep-alive extends lease and deadline
    threading.Event().wait(3 * TTL.total_seconds())
    assert leader.is_leader and etcd_client.lease_ttl(lease_id) > 0
    assert not standby.try_acquire()
    leader.resign()
    assert standby.try_acquire()  # the key went with the revoked lease
    assert standby.current_leader() == "b"
    standby.resign()


def test_a_lost_lease_ends_leadership_and_a_standby_takes_over(
    etcd_client: EtcdClient, key_prefix: str
) -> None:
    leader = LeaderElection(etcd_client, "a", TTL, key=key_prefix + "leader")
    standby = LeaderElection(etcd_client, "b", TTL, key=key_prefix + "leader")
    assert leader.try_acquire()
    etcd_client.revoke_lease(_lease_of(etcd_client, key_prefix + "leader"))  # behind its back
    assert _until(lambda: not leader.is_leader)
    assert _until(standby.try_acquire)
    assert not leader.try_acquire()  # campaigns afresh, and finds the standby leading
    standby.resign()
