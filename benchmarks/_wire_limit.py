"""What this machine's wire allows: one point-to-point copy of N bytes on 127.0.0.1.

Used by ``recovery_at_size.py``: a heal's throughput is given as a share of
the throughput of one plain transfer of the same number of bytes between two
fresh processes, measured in the same run, over

* ``gloo``: a gloo ``send``/``recv`` of one flat tensor (the transport the
  in-process hot-swap uses on CPU), the group formed on a ``TCPStore`` at
  127.0.0.1 as the runtime forms its own;
* ``socket``: a raw TCP socket, ``sendall`` of the buffer on one side and
  ``recv_into`` a buffer on the other.

As in a heal, the sender's buffer is filled before the clock starts and the
receiver's is allocated but never touched (its pages fault in as the bytes
arrive).  The receiver times the transfer, from the moment it is ready (after
a barrier: a one-element message on gloo, one byte of ``go`` on the socket)
to its last byte.  Each process also reports its peak resident memory
(``VmHWM``) and its resident memory before the transfer.

Run as a script, it is one side of one transfer (``recovery_at_size.py``
starts both): ``_wire_limit.py {gloo,socket} {send,recv} BYTES [PORT]``; the
side started first (gloo: the sender, it hosts the store; socket: the
receiver, it listens) prints its port on its first line, and every side
prints one JSON object last.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Bytes asked of ``recv_into`` at once.
_CHUNK = 4 << 20
_TIMEOUT = timedelta(minutes=10)


def _status_bytes(field: str) -> int | None:
    text = Path("/proc/self/status").read_text()
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def _gloo(role: str, nbytes: int, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rank = 0 if role == "send" else 1
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=_TIMEOUT, wait_for_workers=False
    )
    if rank == 0:
        print(store.port, flush=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=_TIMEOUT)
    if rank == 0:
        buf = torch.full((nbytes,), 7, dtype=torch.uint8)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    rss = _status_bytes("VmRSS")
    ready = torch.zeros(1)
    if rank == 0:  # the receiver is ready: its clock starts now
        dist.recv(ready, src=1)
    else:
        dist.send(ready, dst=0)
    started = time.perf_counter()
    if rank == 0:
        dist.send(buf, dst=1)
    else:
        dist.recv(buf, src=0)
    seconds = time.perf_counter() - started
    ok = rank == 0 or bool(buf[-1] == 7 and buf[0] == 7)
    dist.barrier()
    dist.destroy_process_group()
    return {"seconds": seconds, "ok": ok, "rss_before_bytes": rss}


def _socket(role: str, nbytes: int, port: int) -> dict[str, Any]:
    import torch

    if role == "recv":
        with socket.create_server(("127.0.0.1", 0)) as server:
            print(server.getsockname()[1], flush=True)
            conn, _ = server.accept()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = buf.numpy().data
        rss = _status_bytes("VmRSS")
        with conn:
            conn.sendall(b"g")
            started = time.perf_counter()
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:], min(_CHUNK, nbytes - got))
                if n == 0:
                    raise ConnectionError(f"the sender closed after {got} of {nbytes} bytes")
                got += n
            seconds = time.perf_counter() - started
            conn.sendall(b"k")
        return {"seconds": seconds, "ok": bool(buf[-1] == 7), "rss_before_bytes": rss}
    data = torch.full((nbytes,), 7, dtype=torch.uint8)
    rss = _status_bytes("VmRSS")
    with socket.create_connection(("127.0.0.1", port)) as conn:
        if conn.recv(1) != b"g":
            raise ConnectionError("the receiver did not say go")
        started = time.perf_counter()
        conn.sendall(data.numpy().data)
        seconds = time.perf_counter() - started
        conn.recv(1)
    return {"seconds": seconds, "ok": True, "rss_before_bytes": rss}


def _side(transport: str, role: str, nbytes: int, port: int = 0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, transport, role, str(nbytes), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"a wire-limit process exited with {proc.returncode}: {out[-2000:]}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def transfer(transport: str, nbytes: int, timeout: float = 600.0) -> dict[str, Any]:
    """One transfer of ``nbytes`` between two fresh processes.

    Returns:
        ``seconds`` (the receiver's clock), ``mb_per_s`` (10^6 bytes per second),
        and each side's ``peak_rss_bytes`` and ``rss_before_bytes``.
    """
    first, second = ("send", "recv") if transport == "gloo" else ("recv", "send")
    a = _side(transport, first, nbytes)
    assert a.stdout is not None
    port = int(a.stdout.readline())
    b = _side(transport, second, nbytes, port)
    try:
        results = {first: _result(a, timeout), second: _result(b, timeout)}
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()
    recv, send = results["recv"], results["send"]
    if not recv["ok"]:
        raise RuntimeError(f"{transport}: the receiver's bytes are not the sender's")
    return {
        "seconds": recv["seconds"],
        "mb_per_s": nbytes / recv["seconds"] / 1e6,
        "sender_peak_rss_bytes": send["peak_rss_bytes"],
        "sender_rss_before_bytes": send["rss_before_bytes"],
        "receiver_peak_rss_bytes": recv["peak_rss_bytes"],
        "receiver_rss_before_bytes": recv["rss_before_bytes"],
    }


def transfers(nbytes: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` transfers over each transport, fresh processes each time, the
    transports alternating (a load that drifts weighs on both alike)."""
    out: dict[str, list[dict[str, Any]]] = {"gloo": [], "socket": []}
    for _ in range(rounds):
        for transport, done in out.items():
            done.append(transfer(transport, nbytes))
    return out


def _main(argv: list[str]) -> None:
    transport, role, nbytes, port = argv[0], argv[1], int(argv[2]), int(argv[3])
    side = _gloo if transport == "gloo" else _socket
    out = side(role, nbytes, port)
    out["peak_rss_bytes"] = _status_bytes("VmHWM")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
