"""etcd out of space: a real etcd with a tiny quota, filled until it raises NOSPACE.

The client names the refusal and counts it as etcd being away; `ringmaster
status` and the controller's metrics show it; once space is freed (delete,
compact, defragment) and the alarm disarmed, writes go on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest

from orchestrator.api import EtcdUnavailableError
from orchestrator.cli import main
from orchestrator.etcd import health
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.diagnosis import EtcdNoSpaceError
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.health import QUOTA_ENV, read_health
from orchestrator.etcd.options import EtcdOptions
from orchestrator.observe.metrics import JobMetrics
from orchestrator.settings import Settings
from orchestrator.state import events, jobs, keys

pytestmark = pytest.mark.integration

QUOTA = 4 * 1024 * 1024
VALUE = b"n" * (200 * 1024)


@pytest.fixture
def small_etcd(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedEtcd]:
    monkeypatch.setattr(health, "SETTINGS", Settings.from_environ({QUOTA_ENV: str(QUOTA)}))
    with EmbeddedEtcd(quota_bytes=QUOTA) as server:
        yield server


def _fill(client: EtcdClient) -> EtcdNoSpaceError:
    """Write until etcd refuses for want of space; returns the refusal."""
    for i in range(200):
        try:
            client.put(f"/ringmaster/fill/{i:04d}", VALUE)
        except EtcdNoSpaceError as e:
            return e
    raise AssertionError(f"etcd with a {QUOTA}-byte quota took 200 x {len(VALUE)} bytes")


def _metric(client: EtcdClient) -> str:
    metrics = JobMetrics()
    metrics.watch_etcd(client)
    return generate_latest(metrics.registry).decode()


def test_nospace_is_named_shown_and_cleared(small_etcd: EmbeddedEtcd) -> None:
    client = connect(EtcdOptions((small_etcd.endpoint,)))
    try:
        job = "full-job"
        events.emit(client, job, "Run", "submitted before etcd filled up")
        assert "NOSPACE" not in (jobs.etcd_warning(client) or "")
        assert 'ringmaster_etcd_alarm{kind="NOSPACE"} 0.0' in _metric(client)

        refused = _fill(client)
        # a named error, an outage for whoever waits etcd out, naming the key
        assert isinstance(refused, EtcdUnavailableError)
        assert "/ringmaster/fill/" in str(refused) and "out of space" in str(refused)
        assert "etcdctl alarm disarm" in str(refused)
        with pytest.raises(EtcdNoSpaceError):
            client.create("/ringmaster/other", b"x")  # transactions are refused too
        with pytest.raises(EtcdNoSpaceError):
            client.lease(5)
        assert client.get("/ringmaster/fill/0000") is not None  # reads still work
        time.sleep(0.3)
        assert client.unreachable_for() >= 0.3  # the job pauses as for a lost quorum

        health = read_health(client)
        assert health.no_space and health.quota_bytes == QUOTA
        assert health.db_bytes is not None and health.db_bytes >= QUOTA * 0.8
        warning = jobs.etcd_warning(client)
        assert warning is not None and "out of space (NOSPACE alarm" in warning
        text = _metric(client)
        assert 'ringmaster_etcd_alarm{kind="NOSPACE"} 1.0' in text
        assert "ringmaster_etcd_quota_bytes 4.194304e+06" in text
        assert "ringmaster_etcd_db_bytes " in text and "ringmaster_etcd_up 1.0" in text

        out = CliRunner().invoke(main, ["status", "--etcd", small_etcd.endpoint])
        assert out.exit_code == 0, out.output
        assert "warning: etcd is out of space (NOSPACE alarm" in out.output

        # free space (deletes are allowed while the alarm is raised), then disarm
        client.delete_prefix("/ringmaster/fill/")
        client.compact()
        client.defragment()
        assert client.disarm_no_space() == 1
        client.put("/ringmaster/after", b"written again")
        assert client.unreachable_for() == 0.0
        assert jobs.etcd_warning(client) is None
        assert 'ringmaster_etcd_alarm{kind="NOSPACE"} 0.0' in _metric(client)
        # nothing that was kept is lost
        assert [e.message for e in events.list_events(client, job)] == [
            "submitted before etcd filled up"
        ]
    finally:
        client.close()


def test_alarm_found_gone_ends_the_outage(small_etcd: EmbeddedEtcd) -> None:
    """A client that saw NOSPACE counts etcd away until a write works or the alarm is gone."""
    client = connect(EtcdOptions((small_etcd.endpoint,)))
    other = connect(EtcdOptions((small_etcd.endpoint,)))
    try:
        _fill(client)
        assert client.unreachable_for() > 0
        other.delete_prefix("/ringmaster/fill/")
        other.compact()
        other.defragment()
        other.disarm_no_space()
        assert client.unreachable_for() > 0  # it has not written since
        assert not client.no_space()  # asked: the alarm is gone
        assert client.unreachable_for() == 0.0
        assert keys.EVENTS_KEPT > 0
    finally:
        client.close()
        other.close()


def test_check_writable_lasts_as_long_as_the_alarm(small_etcd: EmbeddedEtcd) -> None:
    client = connect(EtcdOptions((small_etcd.endpoint,)))
    try:
        client.check_writable()
        _fill(client)
        with pytest.raises(EtcdNoSpaceError, match="NOSPACE alarm raised"):
            client.check_writable()
        client.delete_prefix("/ringmaster/fill/")
        client.compact()
        client.defragment()
        client.disarm_no_space()
        client.check_writable()
    finally:
        client.close()
