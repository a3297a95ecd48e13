"""The etcd-v3 handler as torch elastic drives it: rounds, registration, liveness.

Nodes here are handlers in threads of the test process (each handler is a
distinct node to torch) or, where death must be real, a subprocess killed
with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from importlib.metadata import entry_points

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.process_lifetime import free_port
from orchestrator.rendezvous.backend import (
    EtcdRendezvousHandler,
    create_handler,
    handler_factory,
    register,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST = {"last_call_timeout": "1", "join_timeout": "30", "close_timeout": "5", "ttl": "600"}


def _params(etcd: EmbeddedEtcd, run_id: str, lo: int, hi: int, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        "etcd-v3", etcd.endpoint, run_id, lo, hi, local_addr="127.0.0.1", **{**FAST, **conf}
    )


def _run_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _all(calls: list[Callable[[], RendezvousInfo]], timeout: float = 30) -> list[RendezvousInfo]:
    """Run ``calls`` in threads at once; results in order; re-raise the first failure."""
    results: list[RendezvousInfo | BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    out: list[RendezvousInfo] = []
    for r in results:
        if isinstance(r, BaseException):
            raise r
        assert r is not None, "a node did not finish its rendezvous in time"
        out.append(r)
    return out


def _port(info: RendezvousInfo) -> int:
    """The ``MASTER_PORT`` the node's workers would bootstrap through."""
    assert info.bootstrap_store_info is not None
    return info.bootstrap_store_info.master_port


def test_entry_point_and_registry_find_the_handler(etcd: EmbeddedEtcd) -> None:
    found = [ep for ep in entry_points(group="torchrun.handlers") if ep.name == "etcd-v3"]
    assert len(found) == 1
    assert found[0].load() is handler_factory
    creator = handler_factory()
    assert isinstance(creator(_params(etcd, _run_id(), 1, 1)), EtcdRendezvousHandler)
    register()
    register()  # idempotent, and the same creator as the entry point's
    assert rendezvous_handler_registry._registry["etcd-v3"] is creator
    handler = get_rendezvous_handler(_params(etcd, _run_id(), 1, 1))
    assert isinstance(handler, EtcdRendezvousHandler)
    assert handler.get_backend() == "etcd-v3"
    assert rendezvous_handler_registry.create_handler(_params(etcd, _run_id(), 1, 1))


def test_importing_ringmaster_first_still_registers_the_entry_point() -> None:
    # torch loads entry points while its rendezvous package initialises, which
    # here happens in the middle of importing orchestrator.rendezvous.backend.
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
        "import orchestrator.rendezvous.backend\n"
        "from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry\n"
        "print('etcd-v3' in rendezvous_handler_registry._registry)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "True"
    assert "Exception while registering" not in out


def test_rdzv_conf_reaches_the_handler(etcd: EmbeddedEtcd) -> None:
    handler = create_handler(
        _params(
            etcd,
            _run_id(),
            1,
            2,
            join_timeout="7",
            last_call_timeout="2",
            close_timeout="3",
            heartbeat="4",
            keep_alive_interval="2",
            keep_alive_max_attempt="5",
        )
    )
    assert isinstance(handler, EtcdRendezvousHandler)
    s = handler.settings
    assert (s.min_nodes, s.max_nodes) == (1, 2)
    assert s.timeout.join.total_seconds() == 7
    assert s.timeout.last_call.total_seconds() == 2
    assert s.timeout.close.total_seconds() == 3
    assert s.timeout.heartbeat.total_seconds() == 4
    assert s.keep_alive_interval.total_seconds() == 2
    assert s.keep_alive_max_attempt == 5


def test_unreachable_etcd_raises_connection_error_naming_it() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    params = RendezvousParameters("etcd-v3", endpoint, _run_id(), 1, 1, connect_timeout="0.5")
    with pytest.raises(RendezvousConnectionError, match=endpoint):
        create_handler(params)


def test_two_nodes_complete_a_round_and_share_the_store(etcd: EmbeddedEtcd) -> None:
    run_id = _run_id()
    a = create_handler(_params(etcd, run_id, 2, 2))
    b = create_handler(_params(etcd, run_id, 2, 2))
    started = time.monotonic()
    ia, ib = _all([a.next_rendezvous, b.next_rendezvous])
    assert time.monotonic() - started < 10
    assert sorted([ia.rank, ib.rank]) == [0, 1]
    assert ia.world_size == ib.world_size == 2
    # Both got the same worker bootstrap address, published by rank 0.
    assert _port(ia) == _port(ib)
    # The agents' store is shared (and lives in etcd).
    ia.store.set("hello", "from-a")
    assert ib.store.get("hello") == b"from-a"
    assert a.num_nodes_waiting() == 0
    assert not a.is_closed()
    assert a.shutdown()
    deadline = time.monotonic() + 5  # b serves its cached state for up to a second
    while not b.is_closed():
        assert time.monotonic() < deadline, "b never saw the rendezvous closed"
        time.sleep(0.2)
    b.shutdown()


def test_survivors_reform_after_rank0_dies_and_get_a_fresh_master_address(
    etcd: EmbeddedEtcd,
) -> None:
    run_id = _run_id()
    nodes = [create_handler(_params(etcd, run_id, 2, 3)) for _ in range(3)]
    try:
        first = _all([n.next_rendezvous for n in nodes])
        assert [i.rank for i in first] == [0, 1, 2]  # node order: creation order
        old_port = _port(first[0])
        assert {_port(i) for i in first} == {old_port}

        # Node 0 (rank 0, host of the workers' store) dies: no more heartbeats.
        dead = nodes[0]
        assert isinstance(dead, EtcdRendezvousHandler)
        dead._stop_heartbeats()
        dead._shared_tcp_store_server = None  # its server goes away with it
        started = time.monotonic()
        second = _all([nodes[1].next_rendezvous, nodes[2].next_rendezvous])
        took = time.monotonic() - started
        assert [i.rank for i in second] == [0, 1]
        assert all(i.world_size == 2 for i in second)
        new_port = _port(second[0])
        assert _port(second[1]) == new_port != old_port
        # 3 missed 1 s heartbeats + 1 s last call + polling: seconds, not torch's 15 s + 30 s.
        assert took < 10, took
    finally:
        # Each handler's keep-alive timer is stopped here, on this thread: a handler
        # left to the collector may be freed on its own timer's thread, whose finalizer
        # then joins itself (an unraisable error in whichever test runs then).
        for node in nodes:
            node.shutdown()


_NODE = textwrap.dedent(
    """
    import sys, time
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from orchestrator.rendezvous.backend import create_handler
    params = RendezvousParameters(
        "etcd-v3", sys.argv[1], sys.argv[2], 1, 2, local_addr="127.0.0.1",
        last_call_timeout="1", join_timeout="30", ttl="600",
    )
    handler = create_handler(params)
    print("ready", flush=True)
    info = handler.next_rendezvous()
    print(f"joined rank={info.rank} world={info.world_size}", flush=True)
    time.sleep(120)
    """
)


@pytest.mark.timeout(90)
def test_a_sigkilled_node_drops_out_within_seconds(etcd: EmbeddedEtcd) -> None:
    run_id = _run_id()
    here = create_handler(_params(etcd, run_id, 1, 2))
    other = subprocess.Popen(
        [sys.executable, "-c", _NODE, etcd.endpoint, run_id],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        assert other.stdout is not None
        assert other.stdout.readline() == "ready\n"  # torch imported, about to join
        result: list[RendezvousInfo] = []
        t = threading.Thread(target=lambda: result.append(here.next_rendezvous()), daemon=True)
        t.start()
        line = other.stdout.readline()
        t.join(timeout=30)
        assert line.startswith("joined") and "world=2" in line, line
        assert result and result[0].world_size == 2
        os.killpg(other.pid, signal.SIGKILL)
        other.wait(timeout=10)
        started = time.monotonic()
        info = here.next_rendezvous()
        took = time.monotonic() - started
        assert info.world_size == 1 and info.rank == 0
        assert took < 8, f"the dead node held the rendezvous for {took:.1f}s"
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
            other.wait(timeout=10)
        if other.stdout is not None:
            other.stdout.close()
        here.shutdown()
