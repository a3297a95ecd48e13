"""An agent's port answers its job only: the credential in etcd, the probes' bounds.

Real etcd, the agent's real port (:func:`agents.node.agent_port.open_port`, as
every node agent serves it) registered as an agent registers it, real sockets;
and a real agent process and controller for ``ringmaster logs``.  Every
request kind but the status and the watch is refused without the job's port
token and with a wrong one, with one line and nothing else; ``probe-links``
goes only to the job's registered nodes at their registered ports, within
its bounds.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from agents.node import log_files
from agents.node.agent_port import open_port
from orchestrator.api import JobPhase
from orchestrator.cli import main
from orchestrator.controller.link_prober import LinkProber
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.ports.api import RequestError
from orchestrator.ports.link_probe import (
    MAX_PROBE_BYTES,
    MAX_PROBE_PEERS,
    MAX_PROBE_ROUNDS,
    MAX_PROBE_SECONDS,
    PROBE_OP,
    SINK_OP,
    send_probe,
)
from orchestrator.ports.liveness import (
    MAX_REQUEST,
    WATCH_OP,
    WATCHING,
    Liveness,
    LivenessServer,
    ask,
    probe,
    read_line,
)
from orchestrator.spec.job import EntrypointSpec, JobSpec
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs, keys, records
from orchestrator.state.port_credential import TOKEN_BYTES, read_token
from orchestrator.state.records import JobStatus
from tests.faults.processes import REPO, Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MISSING = "refused: the request carries no credential"
WRONG = "refused: the credential sent is not this job's"
#: One request of each kind the port guards (the link sink's stream follows its line).
GUARDED: dict[str, dict[str, Any]] = {
    "logs.index": {"op": "logs.index"},
    "logs.read": {"op": "logs.read", "local_rank": 0},
    "logs.tail": {"op": "logs.tail", "local_rank": 0, "lines": 5},
    SINK_OP: {"op": SINK_OP, "seconds": 0.1},
    PROBE_OP: {"op": PROBE_OP, "peers": {}},
}


def _job() -> str:
    return f"port-{uuid.uuid4().hex[:8]}"


@contextmanager
def agent_port(client: EtcdClient, job: str, node: str, root: Path) -> Iterator[LivenessServer]:
    """``node``'s agent port in ``job``, registered as the agent registers it."""
    with open_port(client, job, node, "127.0.0.1", lambda: {"node": node}, root) as server:
        record = records.NodeRecord(node, "127.0.0.1", 1, 1, [], time.time())
        record.liveness = server.address
        records.write(client, keys.job_node(job, node), record)
        yield server


def exchange(address: str, request: dict[str, Any], stream: bytes = b"") -> list[bytes]:
    """Everything the port sends after its status line to ``request`` (and ``stream``)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        assert read_line(conn, MAX_REQUEST)  # the status line
        conn.sendall(json.dumps(request).encode() + b"\n" + stream)
        conn.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data.splitlines()


def _worker_file(root: Path, job: str, node: str) -> None:
    out = log_files.WorkerLog(log_files.node_dir(root, job, node) / "0", 1 << 20)
    for i in range(10):
        out.write(float(i + 1), f"secret line {i}")
    out.close()


@pytest.fixture
def two_ports(
    etcd_client: EtcdClient, tmp_path: Path
) -> Iterator[tuple[str, LivenessServer, LivenessServer]]:
    job = _job()
    _worker_file(tmp_path, job, "n1")
    with (
        agent_port(etcd_client, job, "n1", tmp_path) as n1,
        agent_port(etcd_client, job, "n2", tmp_path) as n2,
    ):
        yield job, n1, n2


@pytest.mark.parametrize("kind", sorted(GUARDED))
@pytest.mark.parametrize(
    ("token", "why"), [(None, MISSING), ("0" * 64, WRONG)], ids=["none", "wrong"]
)
def test_each_request_kind_is_refused_without_the_jobs_credential(
    two_ports: tuple[str, LivenessServer, LivenessServer], kind: str, token: str | None, why: str
) -> None:
    job, n1, n2 = two_ports
    request = {**GUARDED[kind], "job": job}
    if kind == PROBE_OP:
        request["peers"] = {"n2": n2.address}
    if token is not None:
        request["token"] = token
    stream = bytes(256 * 1024) if kind == SINK_OP else b""
    lines = exchange(n1.address, request, stream)
    assert len(lines) == 1, lines  # one line, and nothing else
    answer = json.loads(lines[0])
    assert list(answer) == ["error"], answer
    assert answer["error"].startswith(f"{kind!r} {why}"), answer
    assert keys.job_port_token(job) in answer["error"]  # what to do: where the token is
    assert "secret line" not in lines[0].decode()
    with pytest.raises(RequestError, match=why):
        ask(n1.address, request, token=token)


def test_status_and_watch_answer_without_it_and_the_token_opens_the_rest(
    etcd_client: EtcdClient, two_ports: tuple[str, LivenessServer, LivenessServer]
) -> None:
    job, n1, n2 = two_ports
    verdict, status = probe(n1.address, timeout=2.0)
    assert verdict is Liveness.ALIVE and status == {"node": "n1"}
    host, _, port = n1.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        assert read_line(conn, MAX_REQUEST)
        conn.sendall(json.dumps({"op": WATCH_OP}).encode() + b"\n")
        assert conn.recv(64) == WATCHING  # held open, no credential asked
    token = read_token(etcd_client, job)
    assert len(token) == 2 * TOKEN_BYTES
    index = ask(n1.address, {"op": "logs.index", "job": job}, token=token)
    assert list(index["workers"]) == ["0"]
    tail = ask(
        n1.address, {"op": "logs.tail", "job": job, "local_rank": 0, "lines": 2}, token=token
    )
    assert [text for _, text in tail["lines"]] == ["secret line 8", "secret line 9"]
    assert send_probe(n2.address, 0.05, 1 << 20, token=token) > 0
    with pytest.raises(RequestError, match=WRONG):
        send_probe(n2.address, 0.05, 1 << 20, token=token[::-1])


def test_submit_creates_the_token_once_and_a_new_run_keeps_it(etcd_client: EtcdClient) -> None:
    job = _job()
    spec = JobSpec(name=job, entrypoint=EntrypointSpec(script="train.py")).validate()
    assert jobs.submit(etcd_client, spec) == 1
    token = read_token(etcd_client, job)
    assert len(token) == 2 * TOKEN_BYTES and int(token, 16) >= 0
    records.write(etcd_client, keys.job_status(job), JobStatus(job, phase=JobPhase.STOPPED))
    assert jobs.submit(etcd_client, spec) == 2
    assert read_token(etcd_client, job) == token


def _probe(address: str, token: str, peers: dict[str, str], **bounds: Any) -> dict[str, Any]:
    request = {"op": PROBE_OP, "peers": peers, "seconds": 0.05, "max_bytes": 1 << 20, **bounds}
    return ask(address, request, timeout=30, token=token)


def test_probe_links_goes_only_to_registered_nodes_at_their_ports(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job, other = _job(), _job()
    with ExitStack() as held:
        n1 = held.enter_context(agent_port(etcd_client, job, "n1", tmp_path))
        n2 = held.enter_context(agent_port(etcd_client, job, "n2", tmp_path))
        stranger = held.enter_context(agent_port(etcd_client, other, "s1", tmp_path))
        token = read_token(etcd_client, job)
        answer = _probe(n1.address, token, {"n2": n2.address}, rounds=2)
        assert set(answer["rates"]) == {"n2"} and answer["rates"]["n2"] > 0, answer
        # a node of another job (its agent listens, but is not this job's)
        with pytest.raises(RequestError, match="'s1' is not a registered node of job"):
            _probe(n1.address, token, {"s1": stranger.address})
        # a registered node, at an address that is not its registration's
        with pytest.raises(RequestError, match=f"node 'n2' is registered at {n2.address}"):
            _probe(n1.address, token, {"n2": stranger.address})
        with pytest.raises(RequestError, match="'ghost' is not a registered node"):
            _probe(n1.address, token, {"n2": n2.address, "ghost": "10.0.0.1:9"})


@pytest.mark.parametrize(
    ("bounds", "named"),
    [
        ({"rounds": MAX_PROBE_ROUNDS + 1}, "rounds 5 is not allowed: ask for 1 to 4"),
        ({"rounds": 0}, "rounds 0 is not allowed"),
        ({"seconds": MAX_PROBE_SECONDS * 2}, "seconds 2.0 is not allowed"),
        ({"max_bytes": MAX_PROBE_BYTES + 1}, f"max_bytes {MAX_PROBE_BYTES + 1} is not allowed"),
        ({"max_bytes": 0}, "max_bytes 0 is not allowed"),
    ],
    ids=["rounds", "no-rounds", "seconds", "bytes", "no-bytes"],
)
def test_probe_links_beyond_its_bounds_is_refused(
    etcd_client: EtcdClient,
    two_ports: tuple[str, LivenessServer, LivenessServer],
    bounds: dict[str, Any],
    named: str,
) -> None:
    job, n1, n2 = two_ports
    with pytest.raises(RequestError, match=named):
        _probe(n1.address, read_token(etcd_client, job), {"n2": n2.address}, **bounds)


def test_probe_links_to_too_many_peers_and_a_long_sink_are_refused(
    etcd_client: EtcdClient, two_ports: tuple[str, LivenessServer, LivenessServer]
) -> None:
    job, n1, n2 = two_ports
    token = read_token(etcd_client, job)
    peers = {f"n{i}": n2.address for i in range(MAX_PROBE_PEERS + 1)}
    with pytest.raises(RequestError, match=f"at most {MAX_PROBE_PEERS} per request"):
        _probe(n1.address, token, peers)
    with pytest.raises(RequestError, match="seconds 30 is not allowed"):
        ask(n2.address, {"op": SINK_OP, "seconds": 30}, token=token)


def _wait_for(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return found


def test_the_controllers_prober_sends_the_credential(
    etcd_client: EtcdClient, tmp_path: Path
) -> None:
    job = _job()
    with ExitStack() as held:
        ports = {
            n: held.enter_context(agent_port(etcd_client, job, n, tmp_path)).address
            for n in ("a", "b", "c")
        }
        prober = LinkProber(etcd_client, job)
        prober.start(ports)
        result = _wait_for("the probe's result", prober.take)
    assert result.errors == {}, result
    assert {n: sorted(r) for n, r in result.rates.items()} == {
        "a": ["b", "c"],
        "b": ["a", "c"],
        "c": ["a", "b"],
    }
    assert all(rate > 0 for rates in result.rates.values() for rate in rates.values())
    # a job without a credential in etcd: nothing is asked, every node says why
    lost = LinkProber(etcd_client, _job())
    lost.start(ports)
    nothing = _wait_for("the refused probe's result", lost.take)
    assert nothing.rates == {} and set(nothing.errors) == set(ports)
    assert "has no credential for its agents' ports" in nothing.errors["a"]


def test_ringmaster_logs_reads_a_real_agent_which_refuses_others(
    etcd: EmbeddedEtcd, etcd_client: EtcdClient, tmp_path: Path
) -> None:
    """A real agent and controller: the job is held at step 5 while its output is read."""
    job, go = _job(), tmp_path / "go"
    spec = load_job_data(
        {
            "name": job,
            "entrypoint": {
                "script": str(REPO / "examples" / "train_tiny.py"),
                "args": ["--hold-at", "5", "--go-file", str(go)],
                "env": {"RINGMASTER_LOG_EVERY": "1"},
            },
            "nodes": {"min": 1, "max": 1, "spares": 0},
            "max_steps": 8,
            "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 0},
            "fault_tolerance": {"heartbeat_interval": "500ms"},
        }
    )
    jobs.submit(etcd_client, spec)
    log_dir = tmp_path / "logs"
    worker_dir = log_files.node_dir(log_dir, job, "node-a") / "0"
    endpoint = ["--etcd", etcd.endpoint]
    lines: list[str] = []
    with Services(lines) as services:
        agent = services.start(
            "node-a",
            ["agent", "--job", job, "--node", "node-a", *endpoint],
            env={"RINGMASTER_LOG_DIR": str(log_dir)},
        )
        services.start("controller", ["controller", "--job", job, *endpoint])

        def step_4_on_file() -> bool:
            page = log_files.read_after(worker_dir, None, 1 << 20)
            return any(text.startswith("step 4 ") for _, text in page.lines)

        _wait_for("step 4 in the worker's files", step_4_on_file, timeout=90)
        node = records.read(etcd_client, keys.job_node(job, "node-a"), records.NodeRecord)
        assert node is not None and node.liveness, "\n".join(lines)
        out = CliRunner().invoke(main, ["logs", job, *endpoint])
        assert out.exit_code == 0, out.output
        assert "[node-a/0] step 4 loss" in out.output, out.output
        assert "note:" not in out.output, out.output  # from the agent, not etcd's tails
        assert etcd_client.get_prefix(keys.job_logs(job)) == []  # no tail stored yet
        # the same port, asked by someone without the job's credential
        assert probe(node.liveness, timeout=2.0)[0] is Liveness.ALIVE
        tail = {"op": "logs.tail", "job": job, "local_rank": 0, "lines": 5}
        (refused,) = exchange(node.liveness, tail)
        assert MISSING in json.loads(refused)["error"]
        with pytest.raises(RequestError, match=WRONG):
            ask(node.liveness, tail, token="f" * 64)
        go.touch()
        assert agent.wait(60) == 0, "\n".join(lines)
    assert "Traceback" not in "\n".join(lines)
