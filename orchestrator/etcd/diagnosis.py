"""Why etcd did not answer, in words a person can act on.

The client asks this module three things about a failure:

* is it worth retrying (:func:`transient`: no quorum, an election, an
  unreachable member) or is it final;
* what to tell people about each endpoint (:func:`describe_endpoint`,
  :func:`reason`), and which refusals are about credentials
  (:func:`auth_refusal`, :func:`token_rejected`);
* which refusals are final and have a name of their own: a request over
  etcd's size limit (:class:`EtcdRequestTooLargeError`, permanent), a write
  refused because the database reached its quota (:class:`EtcdNoSpaceError`,
  an outage until an operator frees space), an answer over the client's
  gRPC receive limit (:class:`EtcdResponseTooLargeError`, ask for less);
* whether TLS can work at all between the options and a server
  (:func:`tls_mismatch`): wrong CA, a client certificate the server refuses,
  plain text against a TLS server or the reverse.  Such a mismatch will not
  heal, so ``connect`` fails at once instead of waiting out its timeout.

Passwords never appear in these messages.
"""

from __future__ import annotations

import socket
import ssl
from datetime import timedelta

import etcd3.exceptions as etcd_exc
import grpc

from orchestrator.api import EtcdAuthError, EtcdError, EtcdUnavailableError
from orchestrator.etcd.options import EtcdOptions, host_port


class EtcdRequestTooLargeError(EtcdError):
    """A request over etcd's size limit (``--max-request-bytes``, 1.5 MiB by default).

    Permanent: sending it again fails again.  The writer must store less
    under one key (or split it), not retry.
    """


class EtcdNoSpaceError(EtcdUnavailableError):
    """etcd refused a write because its database reached its quota (the NOSPACE alarm).

    etcd then serves reads and deletes but refuses every put, transaction with
    a put, and lease grant, until an operator compacts and defragments it and
    disarms the alarm (or raises ``--quota-backend-bytes``).  For ringmaster's
    processes this is an outage like a lost quorum (an
    :class:`~orchestrator.api.EtcdUnavailableError`): they wait it out instead
    of failing the job.
    """

    def __init__(self, endpoints: list[str], detail: str, what: str = "") -> None:
        self.endpoints = list(endpoints)
        self.timeout = timedelta(0)
        self.detail = detail
        where = ", ".join(endpoints)
        self.reasons = {ep: f"NOSPACE: {detail}" for ep in endpoints}
        EtcdError.__init__(
            self,
            f"etcd at {where} is out of space and refuses writes{what} ({detail}): its "
            "database reached --quota-backend-bytes and the NOSPACE alarm is raised. Reads "
            "still work. Free space, then disarm the alarm: `etcdctl compact <revision>`, "
            "`etcdctl defrag`, `etcdctl alarm disarm` (or raise --quota-backend-bytes); "
            "see `ringmaster status`",
        )


class EtcdResponseTooLargeError(EtcdError):
    """An answer larger than the client's gRPC receive limit: ask for less at a time."""


class EtcdCompactedError(EtcdError):
    """A read at a revision that etcd has compacted away: read again at a newer one."""


class EtcdLeaseNotFoundError(EtcdError):
    """A write under a lease that has expired (or was revoked): grant a new one."""


#: Errors of the etcd3 library that mean "this endpoint did not serve the call"
#: (a watch not created within the attempt's deadline among them).
RETRYABLE = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
    etcd_exc.WatchTimedOut,
)

# What etcd answers while it has no leader (quorum lost, election running): the
# request reached a member but could not be committed.  Worth retrying.
_NO_QUORUM_DETAILS = (
    "context deadline exceeded",
    "request timed out",
    "no leader",
    "leader changed",
    "raft proposal dropped",
    "too many requests",
)

# What a member answers when its leader is gone or being replaced.
_LEADER_DETAILS = ("request timed out", "no leader", "leader changed", "raft proposal dropped")

# etcd's answers to a request over its size limit: its own check (up to the
# gRPC limit of the server, ``--max-request-bytes`` + 512 KiB) and gRPC's beyond.
_TOO_LARGE_DETAILS = ("request is too large", "received message larger than max")
# The client's own gRPC send limit refusing a request before it leaves.
_SEND_TOO_LARGE_DETAILS = ("sent message larger than max",)
# etcd's answer to a write while the NOSPACE alarm is raised.
_NO_SPACE_DETAILS = ("database space exceeded",)
# etcd's answer to a read at a revision older than its last compaction.
_COMPACTED_DETAILS = ("required revision has been compacted",)
# etcd's answer to a write (or refresh) under a lease it no longer has.
_LEASE_NOT_FOUND_DETAILS = ("requested lease not found",)

#: How long :func:`tls_mismatch` waits for a handshake or for the server to refuse it.
_TLS_PROBE_SECONDS = 1.0


def transient(e: grpc.RpcError) -> bool:
    """True when the call may succeed if tried again (unreachable, no quorum)."""
    code = e.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return True
    details = (e.details() or "").lower()
    return any(d in details for d in _NO_QUORUM_DETAILS)


def request_too_large(e: grpc.RpcError) -> bool:
    """etcd (or the client's own gRPC send limit) refused a request for its size."""
    details = (e.details() or "").lower()
    if any(d in details for d in _SEND_TOO_LARGE_DETAILS):
        return True
    return any(d in details for d in _TOO_LARGE_DETAILS) and not response_too_large(e)


def response_too_large(e: grpc.RpcError) -> bool:
    """The answer was over the client's gRPC receive limit.

    gRPC words both directions alike; the server's refusal of a request is
    prefixed ``grpc:`` (grpc-go), the client's refusal of an answer comes from
    the C core of Python's gRPC, bare or as ``Stream removed (CLIENT: ...)``.
    """
    details = (e.details() or "").lower()
    marker = "received message larger than max"
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (
        details.startswith(marker) or f"client: {marker}" in details
    )


def no_space(e: grpc.RpcError) -> bool:
    """etcd refused a write because the NOSPACE alarm is raised (database over quota)."""
    details = (e.details() or "").lower()
    return any(d in details for d in _NO_SPACE_DETAILS)


def refusal(e: grpc.RpcError, endpoints: tuple[str, ...], what: str) -> EtcdError | None:
    """The named error for a refusal that is not an outage of one member, else None.

    ``what`` says which request it was (`` writing /ringmaster/...``), for the message.
    """
    details = (e.details() or "").lower()
    if no_space(e):
        return EtcdNoSpaceError(list(endpoints), e.details() or "", what)
    if any(d in details for d in _COMPACTED_DETAILS):
        return EtcdCompactedError(f"etcd compacted the revision of a read{what}: {e.details()}")
    if any(d in details for d in _LEASE_NOT_FOUND_DETAILS):
        return EtcdLeaseNotFoundError(f"etcd has no such lease{what}: {e.details()}")
    if response_too_large(e):
        return EtcdResponseTooLargeError(
            f"etcd's answer{what} was over the client's gRPC receive limit: {e.details()}"
        )
    if request_too_large(e):
        return EtcdRequestTooLargeError(
            f"etcd refused a request{what} as too large ({e.details()}); etcd takes at most "
            "--max-request-bytes (1.5 MiB by default) per request: store less under one key"
        )
    return None


def grpc_error(e: BaseException | None) -> grpc.RpcError | None:
    """The gRPC error behind ``e`` (itself, or what the etcd3 library raised it from)."""
    while e is not None:
        if isinstance(e, grpc.RpcError):
            return e
        e = e.__cause__
    return None


def member_down(e: BaseException) -> bool:
    """``e`` says the member itself could not be reached (not etcd answering with an error)."""
    err = grpc_error(e)
    if err is None:
        return isinstance(e, etcd_exc.ConnectionFailedError)
    details = err.details() or ""
    return err.code() == grpc.StatusCode.UNAVAILABLE and not details.startswith("etcdserver:")


def leader_trouble(e: BaseException) -> bool:
    """``e`` may mean that the raft leader is gone (a write lost with it, an election).

    The attempt ran out of time, or the member said its request timed out, the
    leader changed or it knows none.
    """
    if isinstance(e, etcd_exc.ConnectionTimeoutError):
        return True
    err = grpc_error(e)
    if err is None:
        return False
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    details = (err.details() or "").lower()
    return any(d in details for d in _LEADER_DETAILS)


def token_rejected(e: grpc.RpcError) -> bool:
    """The member answering does not know the auth token (another member, expiry)."""
    details = (e.details() or "").lower()
    return e.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in details


def auth_refusal(
    e: grpc.RpcError, endpoints: tuple[str, ...], user: str | None
) -> EtcdAuthError | None:
    """The error to raise when ``e`` is etcd refusing this client's identity, else None."""
    where = f"etcd at {', '.join(endpoints)}"
    if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        who = f"user {user!r}" if user else "no user"
        return EtcdAuthError(
            f"{where} refused the request ({who}): {e.details()}; check --etcd-user / "
            "RINGMASTER_ETCD_USER and the user's role (it needs read-write on the "
            "/ringmaster/ prefix)"
        )
    if "user name is empty" in (e.details() or ""):
        return EtcdAuthError(
            f"{where} requires authentication: pass --etcd-user and --etcd-password (or "
            "RINGMASTER_ETCD_USER / RINGMASTER_ETCD_PASSWORD)"
        )
    return None


def reason(e: Exception) -> str:
    """One line on why a connection attempt failed."""
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    name = type(e).__name__
    text = str(e)
    return f"{name}: {text}" if text else name


def describe_endpoint(endpoint: str, e: Exception | None) -> str:
    """Why ``endpoint`` did not serve a call that failed with ``e``, for people."""
    what = type(e).__name__ if e is not None else "no answer"
    cause = grpc_error(e)
    if cause is not None:
        what = f"{cause.code().name}: {cause.details() or ''}"
    try:
        host, port = host_port(endpoint)
        with socket.create_connection((host, port), timeout=0.3):
            pass
    except OSError as err:
        return f"down or unreachable: {err.strerror or type(err).__name__}"
    except EtcdError:
        return what
    return f"accepts connections but did not answer ({what}): cluster without quorum?"


def _ssl_reason(e: ssl.SSLError) -> str:
    """OpenSSL's short reason (``WRONG_VERSION_NUMBER``...), or ``""`` when there is none."""
    return str(getattr(e, "reason", None) or "")


def plain_text_reply(e: ssl.SSLError) -> bool:
    """The TLS handshake met a peer that does not speak TLS (or hung up on it)."""
    text = f"{_ssl_reason(e)} {e}".upper()
    markers = ("WRONG_VERSION_NUMBER", "RECORD_LAYER", "PACKET_LENGTH", "UNEXPECTED_EOF", "EOF")
    return isinstance(e, ssl.SSLEOFError) or any(m in text for m in markers)


def tls_mismatch(options: EtcdOptions, host: str, port: int) -> str | None:
    """Why TLS between these options and ``host:port`` cannot work, or None.

    Tries a TLS handshake the way the options describe (or, without TLS
    options, whether the server speaks TLS at all) and turns the outcome into
    one sentence naming the endpoint and the option to check.  None when the
    endpoint does not answer at all or the handshake is fine: then TLS is not
    the problem.
    """
    where = f"etcd at {host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=_TLS_PROBE_SECONDS)
    except OSError:
        return None
    with sock:
        if not options.secure:
            return _tls_without_options(sock, host, where)
        try:
            ctx = ssl.create_default_context(cafile=options.ca_cert)
            if options.cert and options.key:
                ctx.load_cert_chain(options.cert, options.key)
        except (ssl.SSLError, OSError, ValueError) as e:
            return (
                f"{where}: cannot use the TLS files given (--etcd-ca / --etcd-cert / "
                f"--etcd-key): {e}"
            )
        try:
            with ctx.wrap_socket(sock, server_hostname=host) as tls:
                tls.settimeout(_TLS_PROBE_SECONDS)
                # TLS 1.3 servers refuse a client certificate after the handshake.
                tls.recv(1)
        except ssl.SSLCertVerificationError as e:
            return (
                f"{where}: its certificate does not verify against --etcd-ca "
                f"{options.ca_cert} ({e.verify_message}); check that --etcd-ca "
                "(RINGMASTER_ETCD_CA) is the CA that signed the server certificate and "
                f"that the certificate names {host}"
            )
        except ssl.SSLError as e:
            return _handshake_refused(e, options, where)
        except (TimeoutError, OSError):
            return None  # the server accepted us and waited for a request: TLS is fine
    return None


def _tls_without_options(sock: socket.socket, host: str, where: str) -> str | None:
    """No TLS options were given: a problem only if the server speaks TLS."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with ctx.wrap_socket(sock, server_hostname=host):
            pass
    except ssl.SSLError as e:
        if plain_text_reply(e):
            return None  # not a TLS server: the failure is something else
    except OSError:
        return None
    return (
        f"{where} serves TLS but no TLS options were given: pass --etcd-ca "
        "(RINGMASTER_ETCD_CA) with the CA that signed its certificate, and "
        "--etcd-cert / --etcd-key if it requires client certificates"
    )


def _handshake_refused(e: ssl.SSLError, options: EtcdOptions, where: str) -> str:
    text = f"{_ssl_reason(e)} {e}".upper()
    if plain_text_reply(e):
        return (
            f"{where} does not answer TLS (it looks like plain http): drop --etcd-ca / "
            "--etcd-cert / --etcd-key or point --etcd at its TLS client endpoint"
        )
    if "CERTIFICATE" in text or "UNKNOWN_CA" in text or "ALERT" in text:
        given = options.cert or "none given"
        return (
            f"{where} refused the client certificate ({given}): check --etcd-cert / "
            "--etcd-key (RINGMASTER_ETCD_CERT / RINGMASTER_ETCD_KEY); etcd wants one "
            "signed by its --trusted-ca-file"
        )
    return (
        f"{where}: TLS handshake failed ({_ssl_reason(e) or e}); check the --etcd-ca / "
        "--etcd-cert / --etcd-key files"
    )
