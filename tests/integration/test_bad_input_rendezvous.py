"""Malformed rendezvous state in etcd gives RendezvousStateError, never a crash or garbage.

The state of a run lives in one etcd key as ``magic + crc32 + state``.  Random
bytes, every truncation and every changed byte of a real encoded state are
written to a real etcd and read back through
:class:`~orchestrator.rendezvous.backend.EtcdRendezvousBackend`: the reader must
return exactly the state written, or raise torch's ``RendezvousStateError``
naming the key.  A writer whose compare-and-set loses to a corrupt state gets
the same error instead of the bad bytes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.rendezvous.backend import EtcdRendezvousBackend, _encode_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STATE = b"\x80\x04\x95 a pickled rendezvous state \x00\x01\x02 with some bytes \xff"
ENCODED = _encode_state(STATE)


@pytest.fixture(scope="module")
def client(etcd: EmbeddedEtcd) -> Iterator[EtcdClient]:
    with connect(EtcdOptions((etcd.endpoint,))) as c:
        yield c


def backend(client: EtcdClient) -> EtcdRendezvousBackend:
    run = f"bad-{uuid.uuid4().hex[:10]}"
    return EtcdRendezvousBackend(client, run, key=f"/ringmaster-test/rdzv/{run}/state")


def read_back(client: EtcdClient, raw: bytes) -> bytes | None:
    """Store ``raw`` as the state key; the state the backend reads, or None on a typed error."""
    b = backend(client)
    client.put(b.key, raw)
    try:
        got = b.get_state()
    except RendezvousStateError as e:
        assert b.key in str(e) and "corrupt" in str(e)
        return None
    assert got is not None
    state, token = got
    assert isinstance(token, int) and token > 0
    return state


def test_a_real_state_reads_back(client: EtcdClient) -> None:
    assert read_back(client, ENCODED) == STATE


@given(st.binary(max_size=64))
@example(b"")
@example(b"rmrdzv1:")
@example(b"rmrdzv1:\x00\x00")
@example(b"rmrdzv1:\x00\x00\x00\x00")  # an empty state has crc 0: a valid encoding
def test_random_bytes(client: EtcdClient, raw: bytes) -> None:
    state = read_back(client, raw)
    if state is not None:  # only a correct encoding may read back
        assert _encode_state(state) == raw


@given(st.integers(min_value=0, max_value=len(ENCODED) - 1))
def test_every_truncation_is_refused(client: EtcdClient, length: int) -> None:
    assert read_back(client, ENCODED[:length]) is None


@given(st.integers(min_value=0, max_value=len(ENCODED) - 1), st.integers(1, 255))
def test_every_changed_byte_is_refused(client: EtcdClient, position: int, xor: int) -> None:
    data = bytearray(ENCODED)
    data[position] ^= xor
    assert read_back(client, bytes(data)) is None


def test_a_writer_that_meets_a_corrupt_state_gets_the_error(client: EtcdClient) -> None:
    b = backend(client)
    client.put(b.key, ENCODED[:-3])
    with pytest.raises(RendezvousStateError, match="corrupt"):
        b.set_state(b"new state")  # no token: creating fails, the current state is corrupt
    kv = client.get(b.key)
    assert kv is not None and kv.value == ENCODED[:-3]  # nothing was overwritten
