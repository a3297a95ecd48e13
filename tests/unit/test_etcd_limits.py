"""Size limits and etcd's space: how refusals are named, write batches, the health sentence."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.api import EtcdUnavailableError
from orchestrator.etcd import diagnosis, health
from orchestrator.etcd.diagnosis import (
    EtcdCompactedError,
    EtcdNoSpaceError,
    EtcdRequestTooLargeError,
    EtcdResponseTooLargeError,
)
from orchestrator.etcd.embedded import QUOTA_BACKEND_BYTES
from orchestrator.etcd.maintenance import alarm_name
from orchestrator.etcd.members import (
    CHANNEL_OPTIONS,
    MAX_RECEIVE_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    MAX_SEND_MESSAGE_BYTES,
)
from orchestrator.etcd.ranges import PAGE_BYTES
from orchestrator.etcd.transactions import REQUEST_OVERHEAD_BYTES, check_request_size, write_batches
from orchestrator.settings import SETTINGS, Settings, SettingsError

pytestmark = pytest.mark.unit


class _Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("code", "details", "named"),
    [
        (EXHAUSTED, "etcdserver: mvcc: database space exceeded", EtcdNoSpaceError),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large", None),
        (EXHAUSTED, "grpc: received message larger than max (2252832 vs. 2097152)", None),
        (EXHAUSTED, "CLIENT: Sent message larger than max (2252832 vs. 2097152)", None),
        (
            EXHAUSTED,
            "Stream removed (CLIENT: Received message larger than max (25167510 vs. 16777216))",
            EtcdResponseTooLargeError,
        ),
        (EXHAUSTED, "Received message larger than max (5 vs. 4)", EtcdResponseTooLargeError),
        (
            grpc.StatusCode.OUT_OF_RANGE,
            "etcdserver: mvcc: required revision has been compacted",
            EtcdCompactedError,
        ),
        (EXHAUSTED, "etcdserver: too many requests", type(None)),
        (grpc.StatusCode.UNAVAILABLE, "connection refused", type(None)),
    ],
)
def test_refusals_have_names(code: grpc.StatusCode, details: str, named: type | None) -> None:
    found = diagnosis.refusal(_Rpc(code, details), ("a:2379",), " writing /k")
    expected = EtcdRequestTooLargeError if named is None else named
    assert type(found) is expected


def test_too_large_is_permanent_and_no_space_an_outage() -> None:
    too_large = diagnosis.refusal(
        _Rpc(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large"), ("a:1",), ""
    )
    assert not isinstance(too_large, EtcdUnavailableError)
    assert "--max-request-bytes" in str(too_large)
    full = diagnosis.refusal(
        _Rpc(EXHAUSTED, "etcdserver: mvcc: database space exceeded"), ("a:1", "b:1"), " writing /k"
    )
    assert isinstance(full, EtcdUnavailableError)  # retry_unavailable waits it out
    assert "etcd at a:1, b:1 is out of space and refuses writes writing /k" in str(full)
    assert full.reasons == {
        "a:1": "NOSPACE: etcdserver: mvcc: database space exceeded",
        "b:1": "NOSPACE: etcdserver: mvcc: database space exceeded",
    }


def test_channel_limits_are_explicit() -> None:
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.max_send_message_length"] == MAX_SEND_MESSAGE_BYTES
    assert options["grpc.max_receive_message_length"] == MAX_RECEIVE_MESSAGE_BYTES
    assert MAX_SEND_MESSAGE_BYTES == MAX_REQUEST_BYTES + 512 * 1024  # etcd's own gRPC limit
    # a first page of values each near etcd's request limit still fits an answer
    assert PAGE_BYTES + MAX_REQUEST_BYTES < MAX_RECEIVE_MESSAGE_BYTES


def test_request_size_check_names_the_key() -> None:
    check_request_size("/k", b"x" * 1000)
    limit = MAX_REQUEST_BYTES - REQUEST_OVERHEAD_BYTES
    check_request_size("/k", b"x" * (limit - 2))
    with pytest.raises(EtcdRequestTooLargeError, match=f"refusing to write /k: {limit + 1} bytes"):
        check_request_size("/k", b"x" * (limit - 1))
    with pytest.raises(EtcdRequestTooLargeError):
        check_request_size("/k", b"x" * 10, extra=limit)


def test_write_batches_bounded_by_count_and_bytes() -> None:
    small = [(f"/s{i}", b"v") for i in range(300)]
    assert [len(b) for b in write_batches(small)] == [128, 128, 44]
    big = [(f"/b{i}", b"x" * (400 * 1024)) for i in range(5)]
    batches = write_batches(big)
    assert [len(b) for b in batches] == [2, 2, 1]
    assert all(sum(len(k) + len(v) for k, v in b) <= PAGE_BYTES or len(b) == 1 for b in batches)
    huge = [("/h", b"x" * (2 * PAGE_BYTES)), ("/s", b"v")]
    assert [len(b) for b in write_batches(huge)] == [1, 1]
    assert [item for b in write_batches(big) for item in b] == big


def test_health_sentences() -> None:
    gib = 1024**3
    assert health.EtcdHealth(100 * 1024**2, 2 * gib).problem() is None
    near = health.EtcdHealth(int(1.7 * gib), 2 * gib)
    assert near.near_full and "nearly full (database 1740.8 MiB of a 2048.0 MiB quota)" in str(
        near.problem()
    )
    full = health.EtcdHealth(2 * gib, 2 * gib, ("NOSPACE",))
    assert full.no_space and "out of space (NOSPACE alarm" in str(full.problem())
    corrupt = health.EtcdHealth(None, 2 * gib, ("CORRUPT",))
    assert "alarms raised: CORRUPT (database unknown" in str(corrupt.problem())


def test_quota_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    def settings(value: str) -> Settings:
        return Settings.from_environ({health.QUOTA_ENV: value})

    monkeypatch.setattr(health, "SETTINGS", settings(""))
    assert health.quota_bytes() == 2 * 1024**3
    monkeypatch.setattr(health, "SETTINGS", settings("1048576"))
    assert health.quota_bytes() == 1048576
    with pytest.raises(SettingsError, match="RINGMASTER_ETCD_QUOTA_BYTES='lots' is not an integer"):
        settings("lots")
    with pytest.raises(SettingsError, match="must be a positive"):
        settings("0")


def test_the_quota_knob_defaults_to_what_the_embedded_etcd_sets() -> None:
    assert SETTINGS.etcd_quota_bytes == QUOTA_BACKEND_BYTES


def test_alarm_names() -> None:
    assert alarm_name(1) == "NOSPACE"
    assert alarm_name(2) == "CORRUPT"
    assert alarm_name(9) == "ALARM9"
