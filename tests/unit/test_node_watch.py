"""The controller's watch of each agent: a killed agent is gone the moment its process
dies, a planned close is not a death (real sockets; a real SIGKILL of a real process)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from orchestrator.controller.node_watch import CONNECT_THREADS, NodeWatch
from orchestrator.ports.liveness import LivenessServer

pytestmark = pytest.mark.unit

AGENT = """
import sys, threading
from orchestrator.ports.liveness import LivenessServer
server = LivenessServer("127.0.0.1", lambda: {"node": "n1"})
print(server.address, flush=True)
threading.Event().wait()
"""


@pytest.fixture
def agent() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """An agent's liveness port in a process of its own: (the process, its address)."""
    proc = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    yield proc, address
    proc.kill()
    proc.wait()
    proc.stdout.close()


def _wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        done.wait(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_agent_is_gone_when_it_dies(agent: tuple[subprocess.Popen[str], str]) -> None:
    proc, address = agent
    told = threading.Event()
    with NodeWatch(on_gone=told.set) as watch:
        watch.follow({"n1": address})
        _wait_until(lambda: watch.watching() == {"n1"}, "the watch to open")
        assert watch.gone() == {}
        proc.send_signal(signal.SIGKILL)
        assert told.wait(10), "the watch did not tell of the death"
        assert list(watch.gone()) == ["n1"]
        # the agent registered again elsewhere (a restart): that one is not gone
        watch.follow({"n1": "127.0.0.1:1"})
        assert watch.gone() == {}


def test_a_planned_close_is_not_a_death() -> None:
    told = threading.Event()
    server = LivenessServer("127.0.0.1", dict)
    with NodeWatch(on_gone=told.set) as watch:
        watch.follow({"n1": server.address})
        _wait_until(lambda: watch.watching() == {"n1"}, "the watch to open")
        server.close()  # the agent leaves: it says bye first
        _wait_until(lambda: watch.watching() == set(), "the watch to end")
        assert not told.is_set() and watch.gone() == {}


def test_an_agent_that_answers_no_watch_is_not_watched_nor_gone() -> None:
    """An agent older than the watch answers it with an error: asked once, not again."""
    asked = []
    with socket.create_server(("127.0.0.1", 0)) as old:

        def serve() -> None:  # the protocol of an agent from before the watch
            conn, _ = old.accept()
            with conn:
                conn.sendall(b'{"node": "old"}\n')
                asked.append(conn.recv(4096))
                conn.sendall(b'{"error": "unknown request \'watch\': this port answers []"}\n')

        threading.Thread(target=serve, daemon=True).start()
        address = f"127.0.0.1:{old.getsockname()[1]}"
        with NodeWatch() as watch:
            watch.follow({"old": address})
            _wait_until(lambda: address in watch._done, "the watch's answer")
            assert watch.watching() == set() and watch.gone() == {}
        assert asked == [b'{"op": "watch"}\n']


def test_nothing_listening_is_not_gone_and_is_watched_once_it_listens() -> None:
    placeholder = socket.socket()
    placeholder.bind(("127.0.0.1", 0))
    port = placeholder.getsockname()[1]
    with NodeWatch() as watch:
        address = f"127.0.0.1:{port}"
        watch.follow({"n1": address})  # registered before it listens
        _wait_until(lambda: address in watch._retry, "the refused attempt")
        assert watch.watching() == set() and watch.gone() == {}
        # a node no longer followed is not tried again (nor waited for: the loop sleeps)
        watch.follow({})
        _wait_until(lambda: not watch._retry, "the retry forgotten")
        placeholder.close()
        with LivenessServer("127.0.0.1", dict) as server:
            watch.follow({"n1": server.address})
            _wait_until(lambda: watch.watching() == {"n1"}, "the watch to open")


def test_an_unfollowed_node_is_let_go_and_the_agent_drops_its_end() -> None:
    with LivenessServer("127.0.0.1", dict) as server:
        with NodeWatch() as watch:
            watch.follow({"n1": server.address})
            _wait_until(lambda: watch.watching() == {"n1"}, "the watch to open")
            watch.follow({})
            _wait_until(lambda: watch.watching() == set(), "the watch to end")
        with NodeWatch() as again:  # a new watch: the server drops the one left behind
            again.follow({"n1": server.address})
            _wait_until(lambda: again.watching() == {"n1"}, "the second watch to open")
            assert len(server._watches) == 1


def test_closing_with_connection_attempts_still_queued_closes_cleanly() -> None:
    """Attempts that the close cancels before they ran opened nothing: the close goes on
    and closes everything it holds (seen in a full run: a cancelled attempt raised out of
    close(), and its wake sockets leaked into a later test)."""
    nodes = {f"n{i}": f"127.0.0.1:{1 + i}" for i in range(20 * CONNECT_THREADS)}
    for _ in range(5):
        watch = NodeWatch(on_gone=lambda: None)
        watch.follow(nodes)
        watch.close()  # most of the attempts are still queued: cancelled
        assert watch.watching() == set()
