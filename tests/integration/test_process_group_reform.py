"""A generation whose group failed to form must not spoil the next one (real gloo processes).

torch prefixes a group's store keys with a name taken from a process-wide
counter.  A survivor whose previous ``init_process_group`` failed (a member
never came) must still meet a fresh replacement, whose counter starts at 0.
"""

from __future__ import annotations

import multiprocessing as mp
import uuid
from datetime import timedelta
from typing import Any

import pytest

from orchestrator.etcd.embedded import EmbeddedEtcd

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
