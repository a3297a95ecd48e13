"""The etcd-v3 rendezvous over TLS with client certificates, against a real TLS etcd.

A throwaway CA, server and client certificate are made for 127.0.0.1; etcd
requires client certificates (``--client-cert-auth``).  The ``--rdzv-conf``
TLS options must get a node through a whole round; without a client
certificate the handler must fail with a connection error naming etcd.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from orchestrator.embedded_etcd import EmbeddedEtcd
from orchestrator.rendezvous import EtcdRendezvousHandler, create_handler

x509 = pytest.importorskip("cryptography.x509")
hashes = pytest.importorskip("cryptography.hazmat.primitives.hashes")
serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
ec = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ec")
oid = pytest.importorskip("cryptography.x509.oid")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _write_key(key: object, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(  # type: ignore[attr-defined]
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _issue(
    name: str,
    ca_key: object,
    ca_name: object,
    usage: object,
    out: Path,
) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(oid.NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = out / f"{name}.pem", out / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedEtcd, Path]]:
    out = tmp_path_factory.mktemp("tls")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(oid.NameOID.COMMON_NAME, "ringmaster-test-ca")])
    now = dt.datetime.now(dt.timezone.utc)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server_cert, server_key = _issue(
        "server", ca_key, ca_name, oid.ExtendedKeyUsageOID.SERVER_AUTH, out
    )
    _issue("client", ca_key, ca_name, oid.ExtendedKeyUsageOID.CLIENT_AUTH, out)
    server = EmbeddedEtcd(
        scheme="https",
        extra_args=[
            "--cert-file",
            str(server_cert),
            "--key-file",
            str(server_key),
            "--trusted-ca-file",
            str(out / "ca.pem"),
            "--client-cert-auth",
        ],
    )
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
        ca_cert=str(certs / "ca.pem"),
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
        ca_cert=str(certs / "ca.pem"),
        connect_timeout="1",
    )
    with pytest.raises(RendezvousConnectionError, match=server.endpoint):
        create_handler(params)
