"""Rendezvous speed: ringmaster's etcd-v3 backend against torch's c10d backend.

A pool of lightweight agent processes (torch elastic rendezvous handlers, no
training) is started once; every trial uses the first N of them, for
N = 2, 4, 8, 16, once with ``etcd-v3`` and once with ``c10d``, in this run:

* **round**: all N agents call ``next_rendezvous()`` at the same instant;
  the time until the last one returns (``min = N - 1``, ``max = N``, so the
  round closes as soon as all N are in).
* **re-form**: one agent stops heartbeating (what a dead or hung node looks
  like to the rendezvous) and the N - 1 others call ``next_rendezvous()``;
  the time until the last survivor returns in a world of N - 1.  Each figure
  is the median of ``RM_BENCH_REPEATS`` trials (default 2).  It contains
  the dead-node timeout (``keep_alive_interval`` 1 s x 3 attempts) and the
  ``last_call_timeout`` (2 s), identical for both backends.  With etcd-v3 the
  agent that stops is the round's rank 0; with c10d it is any agent but the
  one hosting the TCPStore, because losing that one ends the rendezvous
  (shown at the end: ``c10d_survives_store_host_death``).

For the choice of the store that *workers* bootstrap their process group
through, it also times ``init_process_group("gloo")`` + one all-reduce on 4
ranks through the etcd store and through a TCPStore, and single store ops.

Both backends run the same torch ``DynamicRendezvousHandler`` with the same
settings; only where the state lives differs.  The last line of stdout is a
JSON object with the headline figures.  ``--smoke``: N = 2 only, one trial of each
kind, 10 store operations.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._smoke import parse, result_line  # noqa: E402
from orchestrator.etcd.embedded import EmbeddedEtcd  # noqa: E402
from orchestrator.process_lifetime import free_port  # noqa: E402

SIZES = (2, 4, 8, 16)
#: Trials per (backend, N); the median is reported.
REPEATS = int(os.environ.get("RM_BENCH_REPEATS", "2"))
PG_WORLD = 4
CONF = {
    "join_timeout": "60",
    "last_call_timeout": "2",
    "close_timeout": "10",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
    "read_timeout": "20",
}
#: ``--smoke``: the sizes, trials per figure and store operations timed.
SMOKE_SIZES = (2,)
SMOKE_REPEATS = 1
SMOKE_OPS = 10
#: How long the coordinator waits for any one answer from an agent.
REPLY_TIMEOUT = timedelta(seconds=90)


# --------------------------------------------------------------------------- agents


def _agent(index: int, conn: Connection) -> None:
    """One agent process: obeys commands from the coordinator until told to stop."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d store-loss stack traces
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from orchestrator.etcd.client import connect
    from orchestrator.etcd.options import EtcdOptions
    from orchestrator.rendezvous.backend import register
    from orchestrator.rendezvous.store import EtcdStore

    register()
    handler: Any = None
    conn.send({"ready": index})
    while True:
        cmd = conn.recv()
        op = cmd["op"]
        try:
            if op == "stop":
                return
            if op == "die":
                os._exit(0)
            if op == "round":
                params = RendezvousParameters(
                    cmd["backend"],
                    cmd["endpoint"],
                    cmd["run_id"],
                    cmd["min"],
                    cmd["max"],
                    local_addr="127.0.0.1",
                    **cmd["conf"],
                )
                handler = get_rendezvous_handler(params)
                _sleep_until(cmd["t0"])
                info = handler.next_rendezvous()
                conn.send({"t": time.time(), "rank": info.rank, "world": info.world_size})
            elif op == "rejoin":
                _sleep_until(cmd["t0"])
                try:
                    info = handler.next_rendezvous()
                    conn.send({"t": time.time(), "rank": info.rank, "world": info.world_size})
                except Exception as e:
                    conn.send({"t": time.time(), "error": f"{type(e).__name__}: {e}"})
            elif op == "leave":
                handler._stop_heartbeats()
                conn.send({"t": time.time()})
            elif op == "reset":
                if handler is not None:
                    handler._stop_heartbeats()
                handler = None
                conn.send({"ok": True})
            elif op == "pg":
                if cmd["store"] == "etcd":
                    client = connect(EtcdOptions((cmd["endpoint"],)))
                    store: Any = EtcdStore(client, cmd["prefix"], timeout=timedelta(seconds=30))
                else:
                    host, port = cmd["endpoint"].rsplit(":", 1)
                    store = dist.TCPStore(
                        host,
                        int(port),
                        is_master=cmd["rank"] == 0,
                        timeout=timedelta(seconds=30),
                    )
                _sleep_until(cmd["t0"])
                dist.init_process_group(
                    "gloo",
                    store=store,
                    rank=cmd["rank"],
                    world_size=cmd["world"],
                    timeout=timedelta(seconds=30),
                )
                t = torch.ones(1)
                dist.all_reduce(t)
                done = time.time()
                dist.barrier()
                dist.destroy_process_group()
                conn.send({"t": done, "sum": t.item()})
        except Exception as e:
            conn.send({"t": time.time(), "error": f"{type(e).__name__}: {e}"})


def _sleep_until(t0: float) -> None:
    delay = t0 - time.time()
    if delay > 0:
        time.sleep(delay)


class Pool:
    """The agent processes and their command pipes."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_agent, args=(i, theirs), daemon=True)
            p.start()
            self.conns.append(ours)
            self.procs.append(p)
        for c in self.conns:
            self.recv(c)

    def recv(self, conn: Connection) -> dict[str, Any]:
        if not conn.poll(REPLY_TIMEOUT.total_seconds()):
            raise TimeoutError(f"an agent did not answer within {REPLY_TIMEOUT}")
        reply: dict[str, Any] = conn.recv()
        return reply

    def ask(self, indices: list[int], **cmd: Any) -> list[dict[str, Any]]:
        for i in indices:
            self.conns[i].send(cmd)
        return [self.recv(self.conns[i]) for i in indices]

    def close(self) -> None:
        for i, c in enumerate(self.conns):
            if self.procs[i].is_alive():
                c.send({"op": "stop"})
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


# --------------------------------------------------------------------------- trials


def _endpoint(backend: str, etcd: EmbeddedEtcd) -> str:
    return etcd.endpoint if backend == "etcd-v3" else f"127.0.0.1:{free_port()}"


def _conf(backend: str, index: int) -> dict[str, str]:
    # c10d: agent 0 hosts the TCPStore, deterministically.
    return {**CONF, "is_host": str(index == 0).lower()} if backend == "c10d" else dict(CONF)


def trial(pool: Pool, etcd: EmbeddedEtcd, backend: str, n: int) -> dict[str, float]:
    """One round of ``n`` agents, then a re-form of ``n - 1`` after one stops."""
    run_id = f"bench-{backend}-{n}-{uuid.uuid4().hex[:6]}"
    endpoint = _endpoint(backend, etcd)
    members = list(range(n))
    t0 = time.time() + 0.5
    for i in members:
        pool.conns[i].send(
            {
                "op": "round",
                "backend": backend,
                "endpoint": endpoint,
                "run_id": run_id,
                "min": max(n - 1, 1),
                "max": n,
                "conf": _conf(backend, i),
                "t0": t0,
            }
        )
    replies = [pool.recv(pool.conns[i]) for i in members]
    _check(replies, n, f"{backend} round n={n}")
    round_s = max(r["t"] for r in replies) - t0

    ranks = {i: r["rank"] for i, r in zip(members, replies, strict=True)}
    if backend == "etcd-v3":
        leaver = next(i for i in members if ranks[i] == 0)
    else:
        leaver = next(i for i in reversed(members) if i != 0)  # anyone but the store host
    (left,) = pool.ask([leaver], op="leave")
    survivors = [i for i in members if i != leaver]
    replies = pool.ask(survivors, op="rejoin", t0=left["t"])
    _check(replies, n - 1, f"{backend} re-form n={n}")
    reform_s = max(r["t"] for r in replies) - left["t"]
    pool.ask(members, op="reset")
    return {"round_s": round_s, "reform_s": reform_s}


def _check(replies: list[dict[str, Any]], world: int, what: str) -> None:
    errors = [r["error"] for r in replies if "error" in r]
    if errors:
        raise RuntimeError(f"{what}: {errors[0]}")
    worlds = {r["world"] for r in replies}
    if worlds != {world}:
        raise RuntimeError(f"{what}: expected a world of {world}, got {sorted(worlds)}")


def c10d_store_host_death(pool: Pool, first: int) -> tuple[bool, str]:
    """Three c10d agents; the one hosting the TCPStore dies; can the other two re-form?"""
    run_id = f"bench-c10d-host-{uuid.uuid4().hex[:6]}"
    endpoint = f"127.0.0.1:{free_port()}"
    members = [first, first + 1, first + 2]
    t0 = time.time() + 0.5
    for k, i in enumerate(members):
        pool.conns[i].send(
            {
                "op": "round",
                "backend": "c10d",
                "endpoint": endpoint,
                "run_id": run_id,
                "min": 2,
                "max": 3,
                "conf": {**CONF, "is_host": str(k == 0).lower()},
                "t0": t0,
            }
        )
    _check([pool.recv(pool.conns[i]) for i in members], 3, "c10d host round")
    pool.conns[members[0]].send({"op": "die"})
    pool.procs[members[0]].join(timeout=10)
    replies = pool.ask(members[1:], op="rejoin", t0=time.time())
    errors = [r["error"] for r in replies if "error" in r]
    return (not errors, errors[0] if errors else "")


def pg_bootstrap(pool: Pool, etcd: EmbeddedEtcd, store: str, repeats: int = 3) -> float:
    """Median seconds for ``PG_WORLD`` ranks to init gloo and finish one all-reduce."""
    times = []
    for _ in range(repeats):
        endpoint = etcd.endpoint if store == "etcd" else f"127.0.0.1:{free_port()}"
        prefix = f"/ringmaster/bench/pg-{uuid.uuid4().hex[:8]}/"
        t0 = time.time() + 0.3
        members = list(range(PG_WORLD))
        for r in members:
            pool.conns[r].send(
                {
                    "op": "pg",
                    "store": store,
                    "endpoint": endpoint,
                    "prefix": prefix,
                    "rank": r,
                    "world": PG_WORLD,
                    "t0": t0,
                }
            )
        replies = [pool.recv(pool.conns[r]) for r in members]
        errors = [x["error"] for x in replies if "error" in x]
        if errors:
            raise RuntimeError(f"process group through {store}: {errors[0]}")
        times.append(max(x["t"] for x in replies) - t0)
    return statistics.median(times)


def store_op_ms(etcd: EmbeddedEtcd, ops: int = 200) -> dict[str, float]:
    """Median milliseconds of a set + get pair on each store, from one process."""
    import torch.distributed as dist

    from orchestrator.etcd.client import connect
    from orchestrator.etcd.options import EtcdOptions
    from orchestrator.rendezvous.store import EtcdStore

    client = connect(EtcdOptions((etcd.endpoint,)))
    stores: dict[str, Any] = {
        "etcd": EtcdStore(client, f"/ringmaster/bench/ops-{uuid.uuid4().hex[:8]}/"),
        "tcp": dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10)),
    }
    out = {}
    for name, s in stores.items():
        samples = []
        for i in range(ops):
            started = time.perf_counter()
            s.set(f"k{i}", b"v")
            s.get(f"k{i}")
            samples.append((time.perf_counter() - started) * 1000)
        out[name] = statistics.median(samples)
    client.close()
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    args = parse(argparse.ArgumentParser(description=__doc__.split("\n")[0]), {})
    sizes = SMOKE_SIZES if args.smoke else SIZES
    repeats = SMOKE_REPEATS if args.smoke else REPEATS
    started = time.monotonic()
    results: dict[str, float | bool | str] = {}
    with EmbeddedEtcd() as etcd:
        # the store-host test takes the three agents past the largest N
        agents = max(max(sizes) + 3, PG_WORLD)
        print(f"etcd at {etcd.endpoint}; starting {agents} agent processes ...")
        pool = Pool(agents)
        try:
            print(f"agents ready after {time.monotonic() - started:.1f}s")
            print(f"{'N':>3} {'backend':>8} {'round s':>8} {'re-form s':>9}")
            for n in sizes:
                for backend in ("etcd-v3", "c10d"):
                    runs = [trial(pool, etcd, backend, n) for _ in range(repeats)]
                    r = {m: statistics.median(x[m] for x in runs) for m in ("round_s", "reform_s")}
                    key = backend.replace("-", "_")
                    results[f"{key}_round_s_n{n}"] = round(r["round_s"], 3)
                    results[f"{key}_reform_s_n{n}"] = round(r["reform_s"], 3)
                    print(f"{n:>3} {backend:>8} {r['round_s']:>8.2f} {r['reform_s']:>9.2f}")
                for what in ("round", "reform"):
                    ratio = results[f"etcd_v3_{what}_s_n{n}"] / results[f"c10d_{what}_s_n{n}"]  # type: ignore[operator]
                    results[f"ratio_etcd_v3_over_c10d_{what}_n{n}"] = round(ratio, 3)
                print(
                    f"    ratio etcd-v3 / c10d: round "
                    f"{results[f'ratio_etcd_v3_over_c10d_round_n{n}']:.2f}x, re-form "
                    f"{results[f'ratio_etcd_v3_over_c10d_reform_n{n}']:.2f}x"
                )
            for store in ("etcd", "tcp"):
                s = pg_bootstrap(pool, etcd, store, repeats=1 if args.smoke else 3)
                results[f"pg_init_allreduce_s_w{PG_WORLD}_{store}_store"] = round(s, 3)
                print(f"gloo init + all-reduce, {PG_WORLD} ranks, {store} store: {s:.3f}s")
            ops = store_op_ms(etcd, ops=SMOKE_OPS if args.smoke else 200)
            for name, ms in ops.items():
                results[f"store_set_get_ms_{name}"] = round(ms, 3)
                print(f"set+get round trip, {name} store: {ms:.3f} ms")
            survives, error = c10d_store_host_death(pool, agents - 3)
            results["c10d_survives_store_host_death"] = survives
            results["c10d_store_host_death_error"] = error[:200]
            print(f"c10d after the store host died: {'re-formed' if survives else error}")
        finally:
            pool.close()
    results["total_runtime_s"] = round(time.monotonic() - started, 1)
    print(result_line(results, args.smoke, sort_keys=True))


if __name__ == "__main__":
    main()
