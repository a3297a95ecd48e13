"""How ``--rdzv-endpoint`` / ``--rdzv-conf`` become etcd options and timeouts (no etcd)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from orchestrator.etcd.kv import KeyValue
from orchestrator.rendezvous.backend import (
    DEFAULT_ETCD_PORT,
    EtcdRendezvousBackend,
    create_handler,
    etcd_options,
    rendezvous_timeout,
)

pytestmark = pytest.mark.unit


def _params(endpoint: str = "127.0.0.1:2379", **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, "run-1", 1, 2, **conf)


def test_endpoints_default_port_and_several_members() -> None:
    opts = etcd_options(_params("etcd-a,etcd-b:3379 , 10.0.0.1:2379"))
    assert opts.endpoints == (f"etcd-a:{DEFAULT_ETCD_PORT}", "etcd-b:3379", "10.0.0.1:2379")
    assert not opts.secure


def test_https_protocol_and_tls_files() -> None:
    opts = etcd_options(
        _params("etcd:2379", protocol="https", ca_cert="/ca.pem", cert="/c.pem", key="/k.pem")
    )
    assert opts.endpoints == ("https://etcd:2379",)
    assert (opts.ca_cert, opts.cert, opts.key) == ("/ca.pem", "/c.pem", "/k.pem")
    assert opts.secure


def test_torch_v2_tls_option_names_are_accepted() -> None:
    opts = etcd_options(
        _params("https://etcd:2379", cacert="/ca.pem", ssl_cert="/c.pem", ssl_cert_key="/k.pem")
    )
    assert opts.endpoints == ("https://etcd:2379",)
    assert (opts.ca_cert, opts.cert, opts.key) == ("/ca.pem", "/c.pem", "/k.pem")


def test_user_password_and_password_env(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = etcd_options(_params(user="trainer", password="s3cret"))
    assert (opts.user, opts.password) == ("trainer", "s3cret")
    assert "s3cret" not in repr(opts)
    monkeypatch.setenv("RDZV_PW", "from-env")
    assert etcd_options(_params(user="trainer", password_env="RDZV_PW")).password == "from-env"
    with pytest.raises(ValueError, match="NOPE_PW is not set"):
        etcd_options(_params(user="trainer", password_env="NOPE_PW"))


def test_etcd_timeouts() -> None:
    opts = etcd_options(_params(connect_timeout="2.5", op_timeout="4"))
    assert opts.connect_timeout == timedelta(seconds=2.5)
    assert opts.op_timeout == timedelta(seconds=4)


@pytest.mark.parametrize(
    ("endpoint", "conf", "match"),
    [
        ("", {}, "needs --rdzv-endpoint"),
        ("etcd:2379", {"protocol": "ftp"}, "use http or https"),
        ("etcd:2379", {"connect_timeout": "soon"}, "not a number of seconds"),
    ],
)
def test_bad_options_say_what_is_wrong(endpoint: str, conf: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        etcd_options(_params(endpoint, **conf))


def test_standard_timeouts_and_torch_defaults() -> None:
    t = rendezvous_timeout(
        _params(join_timeout="60", last_call_timeout="2", close_timeout="5", heartbeat="3")
    )
    assert (t.join, t.last_call, t.close, t.heartbeat) == (
        timedelta(seconds=60),
        timedelta(seconds=2),
        timedelta(seconds=5),
        timedelta(seconds=3),
    )
    d = rendezvous_timeout(_params())
    assert (d.join, d.last_call, d.close, d.heartbeat) == (
        timedelta(seconds=600),
        timedelta(seconds=30),
        timedelta(seconds=30),
        timedelta(seconds=5),
    )


@pytest.mark.parametrize("conf", [{"keep_alive_interval": "0"}, {"keep_alive_max_attempt": "0"}])
def test_bad_keep_alive_is_rejected_before_connecting(conf: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="must be positive integers"):
        create_handler(_params("127.0.0.1:1", **conf))


class _NoEtcd:
    endpoints = ("nowhere:2379",)


@pytest.mark.parametrize("raw", [b"", b"{json}", b"rmrdzv1", b"rmrdzv1:\x01\x02\x03\x04state"])
def test_state_decoding_rejects_corrupt_values(raw: bytes) -> None:
    backend = EtcdRendezvousBackend(_NoEtcd(), "run-1")  # type: ignore[arg-type]
    kv = KeyValue(backend.key, raw, mod_revision=5, create_revision=1, version=1, lease_id=0)
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend._decode(kv)
