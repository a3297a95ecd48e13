"""Ports picked for a child to listen on are distinct (:func:`free_ports`).

Seen in a full run: an embedded etcd was given one port for both its client and
its peer listener (two calls of ``free_port`` returned the same released port),
and failed to start with "address already in use".
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.process_lifetime import free_ports

pytestmark = pytest.mark.unit


def test_free_ports_are_distinct_and_free() -> None:
    for _ in range(50):
        ports = free_ports(6)
        assert len(set(ports)) == 6, ports
    for port in free_ports(3):  # released again: each can be listened on
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_an_embedded_etcd_never_listens_twice_on_one_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not started: the ports it would listen on.  A port given for one listener may be
    free, so the free ports offered may include it: the other listener never takes it."""
    etcd = EmbeddedEtcd(data_dir=tmp_path)
    assert etcd.client_port != etcd.peer_port
    offered = free_ports(3)
    monkeypatch.setattr("orchestrator.etcd.embedded.free_ports", lambda count: list(offered))
    for given in offered:
        etcd = EmbeddedEtcd(data_dir=tmp_path, client_port=given)
        assert etcd.client_port == given and etcd.peer_port != given
        etcd = EmbeddedEtcd(data_dir=tmp_path, peer_port=given)
        assert etcd.peer_port == given and etcd.client_port != given
