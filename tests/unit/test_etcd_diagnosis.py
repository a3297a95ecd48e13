"""How the client classifies etcd's refusals: retry, renew the token, or stop with advice."""

from __future__ import annotations

import socket
import ssl

import grpc
import pytest

from orchestrator.etcd import diagnosis

pytestmark = pytest.mark.unit


class _Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "transient"),
    [
        (grpc.StatusCode.UNAVAILABLE, "connection refused", True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", True),
        (grpc.StatusCode.UNKNOWN, "etcdserver: request timed out", True),
        (grpc.StatusCode.UNKNOWN, "etcdserver: no leader", True),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided", False),
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", False),
    ],
)
def test_transient(code: grpc.StatusCode, details: str, transient: bool) -> None:
    assert diagnosis.transient(_Rpc(code, details)) is transient


def test_auth_refusals_say_what_to_check_and_never_the_password() -> None:
    denied = _Rpc(grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied")
    err = diagnosis.auth_refusal(denied, ("a:2379", "b:2379"), "trainer")
    assert err is not None
    assert "etcd at a:2379, b:2379 refused the request (user 'trainer')" in str(err)
    assert "--etcd-user" in str(err)
    empty = _Rpc(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty")
    err = diagnosis.auth_refusal(empty, ("a:2379",), None)
    assert err is not None and "requires authentication" in str(err)
    other = _Rpc(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert diagnosis.auth_refusal(other, ("a:2379",), None) is None


def test_an_unknown_token_is_renewed_not_reported() -> None:
    stale = _Rpc(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")
    assert diagnosis.token_rejected(stale)
    assert not diagnosis.token_rejected(_Rpc(grpc.StatusCode.UNAUTHENTICATED, "bad password"))


def test_an_endpoint_that_refuses_connections_is_described_as_down() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nobody listens
    assert diagnosis.describe_endpoint(f"127.0.0.1:{port}", None).startswith("down or unreachable")
    assert diagnosis.describe_endpoint("no-port", None) == "no answer"


def test_reason_and_plain_text_reply() -> None:
    assert diagnosis.reason(_Rpc(grpc.StatusCode.UNAVAILABLE, "refused")) == "UNAVAILABLE: refused"
    assert diagnosis.reason(TimeoutError()) == "TimeoutError"
    assert diagnosis.plain_text_reply(ssl.SSLEOFError())
    assert not diagnosis.plain_text_reply(ssl.SSLError(1, "[SSL: CERTIFICATE_VERIFY_FAILED]"))
