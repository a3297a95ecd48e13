"""A job whose first active node runs in a network namespace, ready to be cut off.

Used by the partition test (tests/chaos/test_partition.py) and the partition
row of benchmarks/recovery.py: a one-member etcd reachable from the
namespace, a controller, ``node-a`` (agent and workers) inside ``isolated``,
``node-b`` on the host, and the spare ``node-c``, started once generation 1
runs so that ``node-a`` (first in name order) is active.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.options import EtcdOptions
from orchestrator.spec.job import JobSpec
from orchestrator.state import jobs, keys, records
from orchestrator.state.records import Plan
from tests.faults.etcd_cluster import EtcdCluster
from tests.faults.netns import IsolatedNode
from tests.faults.processes import Services


@dataclass
class PartitionedJob:
    """The running job: its etcd client and the service processes."""

    client: EtcdClient
    services: Services
    first_plan: Plan


@contextlib.contextmanager
def partitioned_job(
    spec: JobSpec, isolated: IsolatedNode, lines: list[str]
) -> Iterator[PartitionedJob]:
    """Start ``spec`` as described in the module docstring; yields once the spare is up."""
    job = spec.name
    with (
        EtcdCluster(1, extra_hosts=(isolated.host_ip,)) as etcd,
        Services(lines) as services,
        connect(EtcdOptions(etcd.endpoints)) as client,
    ):
        jobs.submit(client, spec)
        host_etcd = ["--etcd", ",".join(etcd.endpoints)]
        services.start("controller", ["controller", "--job", job, *host_etcd])

        def agent(node: str, etcd_args: list[str], address: str) -> list[str]:
            labels = f"zone=z,rack=r,host={node}"
            return [
                "agent",
                "--job",
                job,
                "--node",
                node,
                "--labels",
                labels,
                "--address",
                address,
                *etcd_args,
            ]

        services.start(
            "node-a",
            agent(
                "node-a",
                ["--etcd", ",".join(etcd.endpoints_on(isolated.host_ip))],
                isolated.node_ip,
            ),
            env={"GLOO_SOCKET_IFNAME": isolated.node_if},
            prefix=isolated.command([]),
        )
        # the host's nodes talk to node-a over the link, as it talks to them
        host_env = {"GLOO_SOCKET_IFNAME": isolated.host_if}
        services.start("node-b", agent("node-b", host_etcd, isolated.host_ip), env=host_env)
        first = wait_for("generation 1", lambda: records.read(client, keys.job_plan(job), Plan))
        services.start("node-c", agent("node-c", host_etcd, isolated.host_ip), env=host_env)
        yield PartitionedJob(client=client, services=services, first_plan=first)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 90) -> Any:
    """``check()``'s first truthy value, polled every 0.1 s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
