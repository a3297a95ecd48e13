"""A job for a controller under test, with nodes that are plain records.

No training processes: a node is its registration and one worker's beat,
written by the test as an agent would write them."""

from __future__ import annotations

import time

from orchestrator.etcd.client import EtcdClient
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs, keys, records
from orchestrator.state.records import NodeRecord, ProgressRecord


def two_node_job(job: str) -> JobSpec:
    """A job that trains on exactly 2 nodes, beating every 500 ms.

    Its checkpoint root is its own, in this process's memory: the controller
    under test holds it while the job runs, and no other test's job writes there.
    """
    return load_job_data(
        {
            "name": job,
            "entrypoint": {"script": "train.py"},
            "nodes": {"min": 2, "max": 2},
            "fault_tolerance": {"heartbeat_interval": "500ms"},
            "checkpoint": {"url": f"memory://controller-tests/{job}"},
        }
    )


def submit_two_node_job(client: EtcdClient, job: str) -> None:
    """Submit :func:`two_node_job`."""
    jobs.submit(client, two_node_job(job))


def register_nodes(client: EtcdClient, job: str, nodes: list[str]) -> None:
    """Each node registered, with one worker that beats at step 5 of generation 1."""
    now = time.time()
    for node in nodes:
        registration = NodeRecord(node, "127.0.0.1", 1, 1, [1], now, labels={"host": node})
        records.write(client, keys.job_node(job, node), registration)
        beat = ProgressRecord(5, 1, 0, 2, 1, now, now)
        records.write(client, keys.job_progress(job) + keys.worker_id(node, 0), beat)
