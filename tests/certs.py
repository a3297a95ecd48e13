"""Throwaway TLS material for tests: a CA, server and client certificates.

Everything is made with ``cryptography`` for 127.0.0.1 / localhost and valid
for a day.  :func:`make_tls_files` writes a CA, a server certificate and a
client certificate signed by it, plus a client certificate signed by a second,
unrelated CA (a "wrong" identity the server must refuse).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TLSFiles:
    """Paths of the PEM files written by :func:`make_tls_files`."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    foreign_ca: Path
    foreign_client_cert: Path
    foreign_client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return builder.not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(
        now + dt.timedelta(days=1)
    )


def _make_ca(common_name: str, out: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Name, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = out / f"{common_name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, name, path


def _issue(
    common_name: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    usage: x509.ObjectIdentifier,
    out: Path,
) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(_name(common_name))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = out / f"{common_name}.pem", out / f"{common_name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return cert_path, key_path


def make_tls_files(out: Path) -> TLSFiles:
    """Write a CA, a server and a client certificate, and a foreign client identity."""
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_name, ca = _make_ca("ringmaster-test-ca", out)
    server_cert, server_key = _issue(
        "server", ca_key, ca_name, ExtendedKeyUsageOID.SERVER_AUTH, out
    )
    client_cert, client_key = _issue(
        "client", ca_key, ca_name, ExtendedKeyUsageOID.CLIENT_AUTH, out
    )
    other_key, other_name, other_ca = _make_ca("foreign-ca", out)
    foreign_cert, foreign_key = _issue(
        "foreign-client", other_key, other_name, ExtendedKeyUsageOID.CLIENT_AUTH, out
    )
    return TLSFiles(
        ca=ca,
        server_cert=server_cert,
        server_key=server_key,
        client_cert=client_cert,
        client_key=client_key,
        foreign_ca=other_ca,
        foreign_client_cert=foreign_cert,
        foreign_client_key=foreign_key,
    )
