"""The etcd-v3 rendezvous over TLS with client certificates, against a real TLS etcd.

A throwaway CA, server and client certificate are made for 127.0.0.1; etcd
requires client certificates (``--client-cert-auth``).  The ``--rdzv-conf``
TLS options must get a node through a whole round; without a client
certificate the handler must fail with a connection error naming etcd.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from orchestrator.etcd.embedded import EmbeddedEtcd, ServerTLS
from orchestrator.rendezvous.backend import EtcdRendezvousHandler, create_handler
from tests.certs import make_tls_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedEtcd, Path]]:
    out = tmp_path_factory.mktemp("tls")
    files = make_tls_files(out)
    server = EmbeddedEtcd(tls=ServerTLS(files.server_cert, files.server_key, files.ca))
    with server:
        yield server, out


def test_a_round_over_tls_with_client_certificates(
    tls_etcd: tuple[EmbeddedEtcd, Path],
) -> None:
    server, certs = tls_etcd
    params = RendezvousParameters(
        "etcd-v3",
        server.endpoint,
        f"tls-{uuid.uuid4().hex[:8]}",
        1,
        1,
        local_addr="127.0.0.1",
        protocol="https",
        ca_cert=str(certs / "ringmaster-test-ca.pem"),
        cert=str(certs / "client.pem"),
        key=str(certs / "client-key.pem"),
        last_call_timeout="1",
    )
    handler = create_handler(params)
    assert isinstance(handler, EtcdRendezvousHandler)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    info.store.set("over-tls", "yes")
    assert info.store.get("over-tls") == b"yes"
    assert handler.shutdown()


def test_without_a_client_certificate_the_handler_cannot_connect(
    tls_etcd: tuple[EmbeddedEtcd, Path],
) -> None:
    server, certs = tls_etcd
    params = RendezvousParameters(
        "etcd-v3",
        server.endpoint,
        "tls-refused",
        1,
        1,
        protocol="https",
        ca_cert=str(certs / "ringmaster-test-ca.pem"),
        connect_timeout="1",
    )
    with pytest.raises(RendezvousConnectionError, match=server.endpoint):
        create_handler(params)
