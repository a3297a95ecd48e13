"""Fencing and etcd-outage behaviour on a real etcd (and a real 3-member cluster).

* Writes guarded by the plan revision a process joined fail once a newer
  generation is published, and a checkpoint commit guarded the same way
  leaves no manifest (nothing restorable) behind.
* A process that cannot reach etcd cannot prove membership: no commit.
* Across a quorum loss, calls are retried until etcd is back, and a lease
  kept alive through the outage survives it (etcd extends leases when a new
  raft leader is elected), so nodes are not lost because etcd was.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from checkpoint import Checkpointer, TrainState
from checkpoint.api import CheckpointError, CommitFencedError
from orchestrator.api import EtcdUnavailableError
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.kv import KeyValue
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.state import keys, records
from orchestrator.state.api import FencedError
from orchestrator.state.fencing import GenerationFence
from orchestrator.state.records import Plan
from tests.faults.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.integration


@pytest.fixture
def job() -> str:
    return f"fence-{uuid.uuid4().hex[:8]}"


def _publish(client: EtcdClient, job: str, generation: int) -> int:
    return records.write(client, keys.job_plan(job), Plan(generation, []))


def test_guarded_write_fails_after_a_newer_generation(etcd_client: EtcdClient, job: str) -> None:
    fence = GenerationFence(etcd_client, job)
    fence.join(1, _publish(etcd_client, job, 1))
    fence.put(keys.job_checkpoint(job), "from generation 1")
    fence.check()
    _publish(etcd_client, job, 2)
    with pytest.raises(FencedError, match=r"generation 1 is no longer current.*generation 2"):
        fence.put(keys.job_checkpoint(job), "stale")
    with pytest.raises(FencedError, match="fenced out"):
        fence.check()
    kv = etcd_client.get(keys.job_checkpoint(job))
    assert kv is not None and kv.value == b"from generation 1"


def test_process_outside_any_generation_writes_nothing(etcd_client: EtcdClient, job: str) -> None:
    fence = GenerationFence(etcd_client, job)
    with pytest.raises(FencedError, match="no generation"):
        fence.put(keys.job_checkpoint(job), "x")
    assert etcd_client.get(keys.job_checkpoint(job)) is None


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), samples_seen=0)


def _commit_fence(fence: GenerationFence):  # type: ignore[no-untyped-def]
    def check() -> None:
        try:
            fence.check()
        except FencedError as e:
            raise CommitFencedError(str(e)) from e

    return check


def test_fenced_saver_commits_no_checkpoint(
    etcd_client: EtcdClient, job: str, tmp_path: Path
) -> None:
    fence = GenerationFence(etcd_client, job)
    fence.join(1, _publish(etcd_client, job, 1))
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt", keep=5, fence=_commit_fence(fence))
    ckpt.save_now(10, _state())
    _publish(etcd_client, job, 2)  # this saver was replaced meanwhile
    with pytest.raises(CheckpointError, match="no longer current"):
        ckpt.save_now(20, _state())
    infos = ckpt.list()
    assert [i.step for i in infos if i.committed] == [10]
    assert [i.step for i in infos] == [10]  # the refused save's objects are removed
    latest = ckpt.latest()
    assert latest is not None and latest.step == 10


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


def test_unreachable_etcd_means_no_commit(cluster: EtcdCluster, job: str, tmp_path: Path) -> None:
    client = connect(EtcdOptions(cluster.endpoints, op_timeout=timedelta(seconds=1)))
    fence = GenerationFence(client, job)
    fence.join(1, _publish(client, job, 1))
    ckpt = Checkpointer(f"file://{tmp_path}/ckpt", fence=_commit_fence(fence))
    cluster.kill(0)
    cluster.kill(1)  # no quorum: membership cannot be confirmed
    with pytest.raises(CheckpointError, match="cannot confirm generation 1"):
        ckpt.save_now(5, _state())
    assert ckpt.latest() is None
    client.close()


def test_calls_wait_out_a_quorum_loss_and_leases_survive_it(cluster: EtcdCluster, job: str) -> None:
    client = connect(EtcdOptions(cluster.endpoints, op_timeout=timedelta(seconds=1)))
    lease = client.lease(3)
    lost = threading.Event()
    lease.keep_alive(on_lost=lambda _: lost.set())
    client.put(keys.job_node(job, "n1"), "registered", lease=lease)
    time.sleep(2.5)
    assert client.unreachable_for() < 1  # idle is not unreachable
    cluster.kill(0)
    cluster.kill(1)
    with pytest.raises(EtcdUnavailableError, match="without quorum"):
        client.get(keys.job_node(job, "n1"))
    down_at = time.monotonic()
    got: list[object] = []
    reader = threading.Thread(
        target=lambda: got.append(
            retry_unavailable(lambda: client.get(keys.job_node(job, "n1")), "test read")
        ),
        daemon=True,
    )
    reader.start()
    time.sleep(5)  # longer than the lease TTL
    assert reader.is_alive() and not got  # still waiting for etcd
    assert client.unreachable_for() > 4
    # restarted from the main thread: members die with the thread that started them
    cluster.restart(0)
    cluster.restart(1)
    reader.join(60)
    kv = got[0] if got else None
    assert time.monotonic() - down_at > 3
    assert isinstance(kv, KeyValue) and kv.value == b"registered"
    time.sleep(2)  # a few keep-alives after the outage
    assert not lost.is_set()
    assert lease.remaining() > 0
    assert client.last_silence is not None and client.last_silence[1] > 3
    lease.revoke()
    client.close()


def test_keep_alive_reports_a_lost_lease(etcd_client: EtcdClient, job: str) -> None:
    lease = etcd_client.lease(2)
    lost = threading.Event()
    lease.keep_alive(interval=0.2, on_lost=lambda _: lost.set())
    etcd_client.revoke_lease(lease.id)  # gone behind its owner's back
    assert lost.wait(5)
    lease.stop_keepalive()
