"""Opening the etcd members: endpoints, TLS credentials, the auth token.

:func:`open_client` (behind :func:`orchestrator.etcd.client.connect`) tries
every endpoint until one answers, then opens every member for fail-over
(:mod:`orchestrator.etcd.members`).  A failure that will not heal (refused
credentials, a TLS mismatch) ends it at once, with what to check
(:mod:`orchestrator.etcd.diagnosis`).  With user/password the auth token is
sent as call metadata (:func:`authenticate`), which works on plain-text
channels too: gRPC refuses call credentials there.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import etcd3
import grpc
from etcd3 import etcdrpc

from orchestrator.api import EtcdAuthError, EtcdError, EtcdUnavailableError
from orchestrator.etcd import diagnosis
from orchestrator.etcd.members import Member, Members, member_client, start_at
from orchestrator.etcd.options import EtcdOptions, host_port
from orchestrator.etcd.retry import Backoff

#: Pauses between rounds over every endpoint while connecting (jittered, doubling).
CONNECT_PAUSES = (timedelta(seconds=0.2), timedelta(seconds=1))
#: TLS probes of an endpoint that fails to connect, one per round at most: a probe
#: that timed out on a busy machine (the server slow to refuse a handshake) says
#: nothing, and the next round asks again.
TLS_PROBES = 3


def open_client(options: EtcdOptions) -> Members:
    """Every member, once one has answered within ``connect_timeout``; calls start there.

    Endpoints are tried from a random one on, so that clients spread over the
    members.

    Raises:
        EtcdUnavailableError: no endpoint answered; names every endpoint and its error.
        EtcdAuthError: refused credentials, or TLS cannot work with any endpoint that failed.
        EtcdError: an endpoint is malformed or a TLS file cannot be read.
    """
    if not options.endpoints:
        raise EtcdError("no etcd endpoints given; pass --etcd host:port or set RINGMASTER_ETCD")
    _check_credentials(options)
    creds = secure_credentials(options)
    deadline = time.monotonic() + options.connect_timeout.total_seconds()
    backoff = Backoff(*CONNECT_PAUSES)
    reasons: dict[str, str] = {}
    probes: dict[str, int] = {}  # TLS probes per endpoint (one that timed out says nothing)
    tls_problems: dict[str, str] = {}
    first = start_at(len(options.endpoints))
    order = [*options.endpoints[first:], *options.endpoints[:first]]

    def probe(ep: str) -> None:
        """Ask whether ``ep`` fails for a TLS reason (a probe that timed out says nothing)."""
        if ep not in tls_problems and probes.get(ep, 0) < TLS_PROBES:
            probes[ep] = probes.get(ep, 0) + 1
            mismatch = diagnosis.tls_mismatch(options, *host_port(ep))
            if mismatch:
                tls_problems[ep] = mismatch

    def tls_verdict() -> None:
        if tls_problems and set(tls_problems) | set(reasons) >= set(options.endpoints):
            # Every endpoint failed and some for a TLS reason: that will not heal.
            raise EtcdAuthError("; ".join(tls_problems.values()))

    while True:
        tls_verdict()
        for ep in order:
            host, port = host_port(ep)
            remaining = max(deadline - time.monotonic(), 0.2)
            try:
                raw = open_endpoint(options, host, port, creds, remaining)
            except EtcdAuthError:
                raise
            except Exception as e:
                reasons[ep] = diagnosis.reason(e)
                probe(ep)
                continue
            return _members(options, creds, ep, raw)
        if time.monotonic() >= deadline:
            # One connection attempt may have taken the whole deadline after a probe
            # that timed out: before giving up, ask once more why the endpoints failed.
            for ep in order:
                if ep in reasons:
                    probe(ep)
            tls_verdict()
            raise EtcdUnavailableError(list(options.endpoints), options.connect_timeout, reasons)
        time.sleep(min(backoff.next(), max(deadline - time.monotonic(), 0.0)))


def _members(options: EtcdOptions, creds: Any, answered: str, raw: Any) -> Members:
    """Every member; ``raw`` is the client of ``answered``, where calls start."""
    members = []
    for ep in options.endpoints:
        if ep == answered:
            members.append(Member(ep, raw, authenticated=bool(options.user)))
        else:
            host, port = host_port(ep)
            timeout = options.op_timeout.total_seconds()
            members.append(Member(ep, member_client(host, port, creds, timeout)))
    return Members(members, _current=options.endpoints.index(answered))


def secure_credentials(options: EtcdOptions) -> Any:
    """gRPC channel credentials for TLS options, or None for plain text.

    Raises:
        EtcdError: https without a CA, or a TLS file that cannot be read.
    """
    if not options.secure:
        return None
    if not options.ca_cert:
        raise EtcdError("https etcd endpoints need a CA certificate (--etcd-ca)")
    check_tls_files(options)
    try:
        return etcd3.MultiEndpointEtcd3Client.get_secure_creds(
            options.ca_cert, options.key, options.cert
        )
    except OSError as e:
        raise EtcdError(f"cannot read etcd TLS file: {e}") from e


#: PEM block labels: what a certificate file and a private key file begin with.
_CERT_LABEL = b"-----BEGIN CERTIFICATE-----"
_KEY_LABEL = b"PRIVATE KEY-----"


def _read_pem(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise EtcdError(f"cannot read the etcd TLS file {path!r} ({flag}): {e.strerror}") from e


def check_tls_files(options: EtcdOptions) -> None:
    """Refuse TLS files that cannot work, in one line, before gRPC sees them.

    gRPC aborts the whole process on a client certificate without its key (or a key
    without its certificate), and prints raw log lines of its own for a file that is
    not PEM; each of these is a mistake in the options, so it is named here instead.

    Raises:
        EtcdError: a certificate without its key or the other way round, a file that
            cannot be read, or one that holds no PEM block of the kind it should.
    """
    if bool(options.cert) != bool(options.key):
        given, missing = (
            ("--etcd-cert", "--etcd-key")
            if options.cert
            else (
                "--etcd-key",
                "--etcd-cert",
            )
        )
        raise EtcdError(
            f"{given} was given without {missing}: a client certificate and its private "
            "key go together (give both, or neither for server-only TLS)"
        )
    assert options.ca_cert is not None  # checked by the caller
    if _CERT_LABEL not in _read_pem(options.ca_cert, "--etcd-ca"):
        raise EtcdError(
            f"the etcd CA file {options.ca_cert!r} (--etcd-ca) holds no PEM certificate "
            "(a file starting with '-----BEGIN CERTIFICATE-----')"
        )
    if options.cert and options.key:
        cert = _read_pem(options.cert, "--etcd-cert")
        key = _read_pem(options.key, "--etcd-key")
        if _KEY_LABEL in cert and _CERT_LABEL in key:
            raise EtcdError(
                f"--etcd-cert {options.cert!r} holds a private key and --etcd-key "
                f"{options.key!r} a certificate: the two look swapped"
            )
        if _CERT_LABEL not in cert:
            raise EtcdError(
                f"the etcd client certificate {options.cert!r} (--etcd-cert) holds no PEM "
                "certificate"
            )
        if _KEY_LABEL not in key:
            raise EtcdError(
                f"the etcd client key {options.key!r} (--etcd-key) holds no PEM private key"
            )


def authenticate(raw: Any, options: EtcdOptions) -> None:
    """Get a token for ``options.user`` and send it as metadata with every call.

    The etcd3 library also wraps the token in gRPC call credentials, which gRPC
    refuses to send on a plain-text channel; metadata works on both.
    """
    request = etcdrpc.AuthenticateRequest(name=options.user, password=options.password)
    resp = raw.authstub.Authenticate(request, raw.timeout)
    raw.metadata = (("token", resp.token),)
    raw.call_credentials = None
    raw._stubs.pop("watcher", None)  # a watcher keeps the metadata it was made with


def open_endpoint(options: EtcdOptions, host: str, port: int, creds: Any, timeout: float) -> Any:
    """A client of one member that has answered a status call (authenticated with user/password).

    Raises:
        EtcdAuthError: the endpoint refused the user or password.
        Exception: whatever the etcd3 library or gRPC raised (the caller diagnoses it).
    """
    raw = member_client(host, port, creds, timeout)
    try:
        if options.user:
            authenticate(raw, options)
        raw.status()
    except grpc.RpcError as e:
        raw.close()
        if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
            raise EtcdAuthError(
                f"etcd at {host}:{port} refused user {options.user!r}: {e.details()}; "
                "check --etcd-user and --etcd-password / RINGMASTER_ETCD_PASSWORD"
            ) from e
        raise
    except Exception:
        raw.close()
        raise
    raw.timeout = options.op_timeout.total_seconds()
    return raw


def _check_credentials(options: EtcdOptions) -> None:
    if bool(options.user) != bool(options.password):
        missing = "--etcd-password (or RINGMASTER_ETCD_PASSWORD)" if options.user else "--etcd-user"
        raise EtcdError(f"etcd user/password auth needs both; {missing} is missing")
