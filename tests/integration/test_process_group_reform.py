"""A generation whose group failed to form must not spoil the next one (real gloo processes).

torch prefixes a group's store keys with a name taken from a process-wide
counter.  A survivor whose previous ``init_process_group`` failed (a member
never came) must still meet a fresh replacement, whose counter starts at 0.

A store address left by a rank 0 that died must not hold its peers: workers
restarted by their agent re-form their generation, and a peer may read the
dead store's address before the new rank 0 publishes its own.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest

from agents.runtime import group_store
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.state import keys

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _survivor(endpoint: str, job: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from agents.api import RecoveryError
    from agents.runtime.process_group import form_group, teardown_group
    from orchestrator.etcd.client import connect
    from orchestrator.etcd.options import EtcdOptions

    client = connect(EtcdOptions((endpoint,)))
    short = timedelta(seconds=1)
    try:
        form_group(client, job, 1, 0, 2, "127.0.0.1", timeout=short, collective_timeout=short)
        results.put(("survivor", "generation 1 formed without its peer"))
        return
    except RecoveryError:
        pass  # the peer never came: expected
    teardown_group()
    long = timedelta(seconds=30)
    form_group(client, job, 2, 0, 2, "127.0.0.1", timeout=long, collective_timeout=long)
    t = torch.ones(1)
    dist.all_reduce(t)
    teardown_group()
    results.put(("survivor", float(t.item())))


def _newcomer(endpoint: str, job: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from agents.runtime.process_group import form_group, teardown_group
    from orchestrator.etcd.client import connect
    from orchestrator.etcd.options import EtcdOptions

    client = connect(EtcdOptions((endpoint,)))
    long = timedelta(seconds=30)
    form_group(client, job, 2, 1, 2, "127.0.0.1", timeout=long, collective_timeout=long)
    t = torch.ones(1)
    dist.all_reduce(t)
    teardown_group()
    results.put(("newcomer", float(t.item())))


def test_survivor_of_a_failed_formation_meets_a_fresh_peer(etcd: EmbeddedEtcd) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    job = f"reform-{uuid.uuid4().hex[:8]}"
    procs = [
        ctx.Process(target=fn, args=(etcd.endpoint, job, results)) for fn in (_survivor, _newcomer)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert got == {"survivor": 2.0, "newcomer": 2.0}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_dead_store_address_is_passed_over_for_the_next_one(
    etcd_client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = keys.pg_store("restarted", 1) + "master"
    dead = _closed_port()
    etcd_client.put(key, f"127.0.0.1:{dead}")  # the store of a rank 0 that exited
    refused = threading.Event()
    answers = group_store.answers

    def probe(address: tuple[str, int], deadline: float) -> bool:
        ok = answers(address, deadline)
        if not ok:
            refused.set()
        return ok

    monkeypatch.setattr(group_store, "answers", probe)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        live = int(server.getsockname()[1])

        def restarted_rank_0() -> None:
            refused.wait(10)  # its peer tried the dead store first
            etcd_client.put(key, f"127.0.0.1:{live}")

        publisher = threading.Thread(target=restarted_rank_0)
        publisher.start()
        got = group_store.wait_for_store(etcd_client, key, time.monotonic() + 20)
        publisher.join()
    assert refused.is_set()
    assert got == ("127.0.0.1", live)


def test_a_store_that_never_answers_is_named_at_the_deadline(etcd_client: EtcdClient) -> None:
    key = keys.pg_store("restarted", 2) + "master"
    dead = _closed_port()
    etcd_client.put(key, f"127.0.0.1:{dead}")
    with pytest.raises(RuntimeError, match=f"a store that answers \\(last: 127.0.0.1:{dead}\\)"):
        group_store.wait_for_store(etcd_client, key, time.monotonic() + 0.5)
