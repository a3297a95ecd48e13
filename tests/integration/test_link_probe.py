"""Measuring links between agents' ports: the sink, the probe, and a link limited by ``tc``.

Real sockets: agents' ports (:func:`agents.node.agent_port.open_port`, as every
node agent serves them, with real etcd for the job's credential and
registrations; a bare sink where only the link is measured) on this host, and one inside a
network namespace whose veth is limited with ``tbf`` on both ends (needs root;
skipped with the reason where namespaces cannot be made).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agents.node.agent_port import open_port
from orchestrator.etcd.client import EtcdClient
from orchestrator.ports.api import AgentUnreachableError
from orchestrator.ports.link_probe import PROBE_OP, SINK_OP, send_probe, sink
from orchestrator.ports.liveness import LivenessServer, ask
from orchestrator.state import keys, records
from orchestrator.state.port_credential import read_token
from tests.faults.netns import IsolatedNode, unavailable_reason

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _register(client: EtcdClient, job: str, node: str, port: str) -> None:
    record = records.NodeRecord(node, "127.0.0.1", 1, 1, [], time.time(), liveness=port)
    records.write(client, keys.job_node(job, node), record)


def test_an_agent_measures_its_peers_and_says_which_it_could_not_reach(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job = f"links-{uuid.uuid4().hex[:8]}"
    with (
        open_port(etcd_client, job, "a", "127.0.0.1", dict, tmp_path) as a,
        open_port(etcd_client, job, "b", "127.0.0.1", dict, tmp_path) as b,
    ):
        gone = _closed_port()  # a node still registered whose agent is gone
        for node, port in (("a", a.address), ("b", b.address), ("x", gone)):
            _register(etcd_client, job, node, port)
        answer = ask(
            a.address,
            {
                "op": PROBE_OP,
                "peers": {"b": b.address, "x": gone},
                "seconds": 0.1,
                "max_bytes": 4 << 20,
            },
            timeout=30,
            token=read_token(etcd_client, job),
        )
    assert set(answer["rates"]) == {"b"} and answer["rates"]["b"] > 10e6, answer
    assert gone in answer["errors"]["x"], answer


def test_a_port_without_a_sink_is_named() -> None:
    with (
        LivenessServer("127.0.0.1", dict, {"other": dict}) as old,
        pytest.raises(AgentUnreachableError, match="no link sink"),
    ):
        send_probe(old.address, 0.1, 1 << 20)


def _through(rate: str, **limit: str) -> float:
    """The best of two probes to a port inside a namespace whose link is ``rate``."""
    with IsolatedNode("probe") as node:
        node.limit(rate, **limit)
        code = (
            "import sys, time\n"
            "from orchestrator.ports.liveness import LivenessServer\n"
            "from orchestrator.ports.link_probe import SINK_OP, sink\n"
            f"s = LivenessServer({node.node_ip!r}, dict, streams={{SINK_OP: sink}})\n"
            "print(s.address, flush=True)\n"
            "sys.stdin.read()\n"
        )
        env = dict(os.environ, PYTHONPATH=str(REPO))
        with subprocess.Popen(
            node.command([sys.executable, "-c", code]),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as server:
            assert server.stdin is not None and server.stdout is not None
            try:
                remote = server.stdout.readline().strip()
                assert remote, "the namespace's port did not start"
                return max(send_probe(remote, 0.5, 64 << 20) for _ in range(2))
            finally:
                server.stdin.close()  # the server exits at the end of its input


def test_a_link_limited_by_tc_measures_near_its_limit() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    slow = _through("8mbit")
    with LivenessServer("127.0.0.1", dict, streams={SINK_OP: sink}) as local:
        fast = max(send_probe(local.address, 0.1, 16 << 20) for _ in range(2))
    crawl = _through("512kbit", burst="4kb", latency="400ms")  # a small bucket: its burst
    # 8 Mbit/s is 1 MB/s; the bucket's 32 kB burst and the ends' timing leave it near
    assert 0.6e6 < slow < 1.3e6, slow
    assert fast > 20 * slow, (fast, slow)
    # 512 kbit/s is 64 kB/s: what the sink timed, not the queue the reset dropped
    assert 0.6 * 64e3 < crawl < 1.3 * 64e3, crawl
