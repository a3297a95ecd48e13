"""How a client's transport records etcd's silences: one outage is one silence.

No etcd is needed: the calls given to the transport answer at once, and the
times at which they were started (during an outage) are given to it.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

import pytest

from orchestrator.etcd import transport as transport_mod
from orchestrator.etcd.options import EtcdOptions
from orchestrator.etcd.transport import EtcdTransport

pytestmark = pytest.mark.unit


def _answer(client: EtcdTransport, started: float) -> None:
    client._attempt(lambda raw: None, math.inf, started, None)


def test_a_shorter_wait_inside_an_outage_does_not_replace_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport_mod, "SILENCE_THRESHOLD", timedelta(seconds=0.1))
    client = EtcdTransport(EtcdOptions(endpoints=("127.0.0.1:1",)), raw=object())
    now = time.monotonic()
    client._failing_since = now - 1.0  # calls failed for a second
    _answer(client, started=now - 0.5)
    outage = client.last_silence
    assert outage is not None and outage[1] >= 1.0

    _answer(client, started=now - 0.3)  # another call of the same outage, answered later
    assert client.last_silence == outage

    time.sleep(0.05)
    second_start = time.monotonic()
    time.sleep(0.2)
    _answer(client, started=second_start)  # a new silence after the outage ended
    assert client.last_silence is not None and client.last_silence != outage
    assert 0.2 <= client.last_silence[1] < 1.0
