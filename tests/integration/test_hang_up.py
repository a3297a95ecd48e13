"""A survivor that leaves a broken generation hangs up on its peers (real gloo processes).

With two workers per node, a node loss can leave one survivor waiting in a
collective on its local peer, which has already left the generation but still
holds its old group (a pending work, a sharded module, a traceback keep it
alive).  gloo's ``abort()`` and ``shutdown()`` close no connection, so the wait
would last the operation timeout; :func:`agents.runtime.process_group.hang_up` shuts
the group's sockets down and the wait ends at once.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest

from tests.gloo import run_gloo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

#: the group's operation timeout: a wait that is not ended by the hang-up lasts this long
OP_TIMEOUT_S = 6.0


def _leave_while_a_peer_waits(rank: int, world_size: int) -> dict[str, float | str]:
    import torch
    import torch.distributed as dist

    from agents.runtime.process_group import hang_up, socket_inodes, sockets_opened_since

    before = socket_inodes()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=OP_TIMEOUT_S))
    sockets = sockets_opened_since(before, keep_ports=set())
    dist.all_reduce(torch.ones(4), group=group)  # every connection is up
    if rank == 1:  # the survivor that learnt of the break first and left
        time.sleep(0.5)
        shut = hang_up(sockets)
        # the group stays alive until both peers' waits have ended (they meet this rank in
        # a barrier of the world group, whose connections were not hung up, only then):
        # only the hang-up can end the wait
        dist.barrier()
        del group
        return {"shut": float(shut)}
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        error = ""
    except RuntimeError as e:
        error = str(e)
    waited = time.monotonic() - started
    dist.barrier()  # lets the rank that left drop its group
    return {"waited": waited, "error": error}


def test_a_peer_waiting_on_a_survivor_that_hung_up_fails_at_once() -> None:
    results = run_gloo(_leave_while_a_peer_waits, 3, timeout=60)
    assert results[1]["shut"] >= 2  # at least its connections to ranks 0 and 2
    for rank in (0, 2):
        r = results[rank]
        assert r["error"], r
        assert "timed out" not in str(r["error"]).lower(), r
        assert float(r["waited"]) < OP_TIMEOUT_S / 2, r


def test_sockets_to_kept_ports_are_not_the_groups() -> None:
    from agents.runtime.process_group import socket_inodes, sockets_opened_since

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        before = socket_inodes()
        with socket.create_connection(server.getsockname()) as client:
            accepted, _ = server.accept()
            with accepted:
                kept = sockets_opened_since(before, keep_ports={server.getsockname()[1]})
                taken = sockets_opened_since(before, keep_ports=set())
    assert len(taken) == 2  # the client's end and the accepted end
    assert len(kept) == 1  # the accepted end: its remote port is the client's
    assert kept < taken
    assert client  # kept open until both were listed
