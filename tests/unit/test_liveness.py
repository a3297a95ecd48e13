"""The liveness port tells a dead agent from a live or unreachable one (real sockets)."""

from __future__ import annotations

import socket

import pytest

from orchestrator.ports.liveness import Liveness, LivenessServer, probe

pytestmark = pytest.mark.unit


def test_a_live_agent_answers_with_its_workers() -> None:
    with LivenessServer("127.0.0.1", lambda: {"node": "n1", "workers": {"0": True}}) as server:
        verdict, answer = probe(server.address)
    assert verdict is Liveness.ALIVE
    assert answer == {"node": "n1", "workers": {"0": True}}


def test_a_closed_port_means_dead() -> None:
    server = LivenessServer("127.0.0.1", dict)
    address = server.address
    server.close()
    verdict, answer = probe(address)
    assert verdict is Liveness.DEAD and answer == {}


def test_a_port_that_accepts_but_never_answers_is_unknown() -> None:
    # a frozen agent (SIGSTOP): the kernel completes the handshake, nobody answers
    with socket.create_server(("127.0.0.1", 0)) as frozen:
        host, port = frozen.getsockname()
        verdict, _ = probe(f"{host}:{port}", timeout=0.2)
    assert verdict is Liveness.UNKNOWN


def test_a_broken_status_callback_does_not_stop_the_server() -> None:
    calls = {"n": 0}

    def flaky() -> dict[str, object]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return {"ok": True}

    with LivenessServer("127.0.0.1", flaky) as server:
        first, _ = probe(server.address)
        second, answer = probe(server.address)
    assert first is Liveness.UNKNOWN  # accepted, closed without an answer
    assert second is Liveness.ALIVE and answer == {"ok": True}
