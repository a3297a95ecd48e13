"""The agent container's exec probes: readiness = registered; preStop = drain.

No etcd runs in unit tests: a fake client stands in (the registration key is
the only thing the probes read).
"""

from __future__ import annotations

import signal
from datetime import timedelta
from typing import Any

import pytest

from orchestrator.api import EtcdUnavailableError
from orchestrator.etcd.options import EtcdOptions
from orchestrator.operator import probe

pytestmark = pytest.mark.unit

ENV = {
    "RINGMASTER_ETCD": "etcd-0:2379,etcd-1:2379",
    "RINGMASTER_JOB": "demo",
    "RINGMASTER_NODE": "demo-agent-3",
    "RINGMASTER_ETCD_CA": "/etc/etcd/ca.pem",
    "RINGMASTER_DRAIN_TIMEOUT": "5",
}
KEY = "/ringmaster/jobs/demo/nodes/demo-agent-3"


class FakeEtcd:
    """Stands in for an etcd client: a dict of keys; ``gets`` counts reads."""

    def __init__(self, keys: set[str], vanish_after: int | None = None) -> None:
        self.keys = set(keys)
        self.gets = 0
        self.vanish_after = vanish_after
        self.options: EtcdOptions | None = None

    def __call__(self, options: EtcdOptions) -> FakeEtcd:
        self.options = options
        return self

    def __enter__(self) -> FakeEtcd:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def get(self, key: str) -> Any:
        self.gets += 1
        if self.vanish_after is not None and self.gets > self.vanish_after:
            self.keys.discard(key)
        return object() if key in self.keys else None


def test_ready_when_registered() -> None:
    fake = FakeEtcd({KEY})
    assert probe.ready(ENV, open_client=fake) == 0  # type: ignore[arg-type]
    assert fake.options is not None
    assert fake.options.endpoints == ("etcd-0:2379", "etcd-1:2379")
    assert fake.options.ca_cert == "/etc/etcd/ca.pem"
    assert fake.options.op_timeout <= timedelta(seconds=2)


def test_not_ready_before_registration() -> None:
    assert probe.ready(ENV, open_client=FakeEtcd(set())) == 1  # type: ignore[arg-type]


def test_not_ready_when_etcd_is_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    def unreachable(options: EtcdOptions) -> Any:
        raise EtcdUnavailableError(list(options.endpoints), timedelta(seconds=2), {})

    assert probe.ready(ENV, open_client=unreachable) == 1
    assert "not ready" in capsys.readouterr().err


def test_drain_signals_the_agent_and_waits_for_it_to_leave() -> None:
    sent: list[tuple[int, int]] = []
    fake = FakeEtcd({KEY}, vanish_after=2)
    code = probe.drain(
        ENV,
        open_client=fake,  # type: ignore[arg-type]
        kill=lambda pid, sig: sent.append((pid, sig)),
        poll=timedelta(milliseconds=10),
    )
    assert code == 0
    assert sent == [(1, signal.SIGTERM)]
    assert fake.gets == 3


def test_drain_gives_up_after_the_timeout() -> None:
    env = {**ENV, "RINGMASTER_DRAIN_TIMEOUT": "0.1"}
    code = probe.drain(
        env,
        open_client=FakeEtcd({KEY}),  # type: ignore[arg-type]
        kill=lambda pid, sig: None,
        poll=timedelta(milliseconds=10),
    )
    assert code == 1


def test_drain_when_the_agent_is_already_gone() -> None:
    def gone(pid: int, sig: int) -> None:
        raise ProcessLookupError

    assert probe.drain(ENV, open_client=FakeEtcd({KEY}), kill=gone) == 0  # type: ignore[arg-type]


def test_usage() -> None:
    assert probe.main(["nonsense"]) == 2
