"""All-reduce and gradient compression on an emulated two-rack cluster.

Builds four "nodes" as Linux network namespaces in two "racks": each rack is
a bridge in a switch namespace, the two bridges are joined by a veth pair
rate-limited with ``tc … tbf`` in both directions (the slow inter-rack link),
and links inside a rack are plain veths (fast).  Workers run inside the node
namespaces with gloo bound to the node's veth (``GLOO_SOCKET_IFNAME``).

Reports, in one run:

* all-reduce time of a ~100 MB gradient with ranks interleaved across racks
  vs in topology order (:mod:`orchestrator.topology`), one rank per node;
* flat vs hierarchical all-reduce with two ranks per node;
* training step time and final accuracy on a synthetic task for dense fp32,
  fp16, PowerSGD, top-k 1 % and QSGD 8-bit.

Needs root (``ip netns``, ``tc``); skips with a message otherwise.  Always
removes the namespaces it created.  The last stdout line is one JSON object
of headline figures.

Usage::

    python benchmarks/allreduce.py [--size-mb 100] [--rate 200mbit] [--steps 60]

``--smoke``: 1 MB all-reduced once, 12 training steps (past every compressor's
warm-up) of a 64-wide model on batches of 4, across a 1 Gbit/s link.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._smoke import parse, result_line  # noqa: E402
from benchmarks._worker_end import exit_now, keep  # noqa: E402

SUBNET = "10.77.0"
RACK_OF_NODE = (0, 0, 1, 1)
WORKER_TIMEOUT_S = int(os.environ.get("RINGMASTER_BENCH_TIMEOUT", "600"))


# --------------------------------------------------------------------------- cluster


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


@dataclass
class Cluster:
    """Network namespaces of the emulated cluster; ``close()`` removes them all."""

    rate: str
    prefix: str = field(default_factory=lambda: f"rmb{os.getpid() % 100000}")
    created: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def node_ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @staticmethod
    def node_if(node: int) -> str:
        return f"eth{node}"

    @staticmethod
    def node_ip(node: int) -> str:
        return f"{SUBNET}.{10 + node}"

    def _netns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self.created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        sw = self.switch
        self._netns(sw)
        for rack in (0, 1):
            _sh("ip", "-n", sw, "link", "add", f"br{rack}", "type", "bridge")
            _sh("ip", "-n", sw, "link", "set", f"br{rack}", "up")
        # The slow inter-rack link: a veth pair between the bridges, tbf on both ends.
        _sh("ip", "-n", sw, "link", "add", "up0", "type", "veth", "peer", "name", "up1")
        for rack in (0, 1):
            dev = f"up{rack}"
            _sh("ip", "-n", sw, "link", "set", dev, "master", f"br{rack}")
            _sh("ip", "-n", sw, "link", "set", dev, "up")
            _sh(
                "ip",
                "netns",
                "exec",
                sw,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            )
        for node, rack in enumerate(RACK_OF_NODE):
            ns = self.node_ns(node)
            self._netns(ns)
            port = f"p{node}"
            _sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "tmp")
            _sh("ip", "-n", sw, "link", "set", "tmp", "netns", ns)
            _sh("ip", "-n", ns, "link", "set", "tmp", "name", self.node_if(node))
            _sh("ip", "-n", sw, "link", "set", port, "master", f"br{rack}")
            _sh("ip", "-n", sw, "link", "set", port, "up")
            _sh(
                "ip", "-n", ns, "addr", "add", f"{self.node_ip(node)}/24", "dev", self.node_if(node)
            )
            _sh("ip", "-n", ns, "link", "set", self.node_if(node), "up")
        for node in range(1, len(RACK_OF_NODE)):
            ok = _sh(
                "ip",
                "netns",
                "exec",
                self.node_ns(0),
                "ping",
                "-c",
                "1",
                "-W",
                "2",
                self.node_ip(node),
                check=False,
            )
            if ok.returncode != 0 and shutil.which("ping"):
                raise RuntimeError(f"node 0 cannot reach node {node}: {ok.stdout}{ok.stderr}")

    def close(self) -> None:
        for name in reversed(self.created):
            _sh("ip", "netns", "del", name, check=False)
        self.created.clear()


def _can_build() -> str | None:
    """``None`` when namespaces can be built here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root for 'ip netns' and 'tc'"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    probe = f"rmbprobe{os.getpid() % 100000}"
    made = _sh("ip", "netns", "add", probe, check=False)
    _sh("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    return None


# --------------------------------------------------------------------------- launching


def _launch(
    cluster: Cluster, placement: list[int], experiment: str, args: dict[str, Any]
) -> dict[str, Any]:
    """Run one experiment: global rank ``r`` runs on node ``placement[r]``; rank 0's result."""
    world = len(placement)
    master = cluster.node_ip(placement[0])
    port = 29400 + (os.getpid() + int(time.time())) % 2000
    procs = []
    for rank, node in enumerate(placement):
        env = {
            **os.environ,
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(placement.count(node)),
            "GLOO_SOCKET_IFNAME": cluster.node_if(node),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        cmd = [
            "ip",
            "netns",
            "exec",
            cluster.node_ns(node),
            sys.executable,
            str(Path(__file__)),
            "--worker",
            experiment,
            "--worker-args",
            json.dumps(args),
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired as e:
        for p in procs:
            p.kill()
        tails = [p.communicate()[1][-1500:] for p in procs]
        raise RuntimeError(f"{experiment} timed out; stderr tails: {tails}") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            raise RuntimeError(f"{experiment} rank {rank} failed:\n{err[-3000:]}")
    return dict(json.loads(outs[0][0].strip().splitlines()[-1]))


# --------------------------------------------------------------------------- workers


def _init() -> tuple[int, int]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    return dist.get_rank(), dist.get_world_size()


def _time_collective(fn: Any, repeats: int) -> list[float]:
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def worker_allreduce(args: dict[str, Any]) -> dict[str, Any]:
    """Time a plain all-reduce of ``size_mb`` of float32."""
    import torch
    import torch.distributed as dist

    _init()
    x = torch.ones(int(args["size_mb"] * 1e6 / 4))
    dist.all_reduce(torch.ones(1024))
    times = _time_collective(lambda: dist.all_reduce(x), int(args["repeats"]))
    return {"seconds": min(times), "all": times}


def worker_hierarchical(args: dict[str, Any]) -> dict[str, Any]:
    """Time flat vs hierarchical all-reduce with ``LOCAL_WORLD_SIZE`` ranks per node."""
    import torch
    import torch.distributed as dist

    from agents.comm.api import NodeLayout
    from agents.comm.hierarchical import build_groups, hierarchical_average

    _, world = _init()
    groups = build_groups(NodeLayout.from_env(world))
    x = torch.ones(int(args["size_mb"] * 1e6 / 4))
    dist.all_reduce(torch.ones(1024))
    hierarchical_average(torch.ones(1024), groups)
    repeats = int(args["repeats"])
    flat = _time_collective(lambda: dist.all_reduce(x), repeats)
    hier = _time_collective(lambda: hierarchical_average(x, groups), repeats)
    return {"flat_s": min(flat), "hierarchical_s": min(hier), "flat": flat, "hier": hier}


def _task(dim: int, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    means = torch.randn(10, dim, generator=g) * 0.35
    proj = torch.randn(dim, dim, generator=g) / dim**0.5

    def sample(n: int) -> tuple[Any, Any]:
        y = torch.randint(10, (n,), generator=g)
        x = torch.tanh((means[y] + torch.randn(n, dim, generator=g)) @ proj) * 2
        return x, y

    xt, yt = sample(8192)
    xv, yv = sample(4096)
    return xt, yt, xv, yv


def worker_train(args: dict[str, Any]) -> dict[str, Any]:
    """Train the same model with each comm config; step time and accuracy per config."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from agents.comm import build_comm_hook
    from orchestrator.spec.job import CommSpec, CompressionKind, CompressionSpec

    rank, world = _init()
    dim, hidden, steps, batch = 256, int(args["hidden"]), int(args["steps"]), int(args["batch"])
    xt, yt, xv, yv = _task(dim)
    results: dict[str, Any] = {}
    for name, params in args["configs"].items():
        spec = CommSpec(
            compression=CompressionSpec(**{**params, "type": CompressionKind(params["type"])})
        )
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden // 2),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden // 2, 10),
        )
        ddp = keep(DDP(model))  # never freed: see benchmarks/_worker_end.py
        hook = build_comm_hook(spec, ddp)
        hook.register(ddp)
        dgc = spec.compression.type == CompressionKind.TOPK and spec.compression.momentum > 0
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.0 if dgc else 0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
        print(f"rank {rank} config {name}", file=sys.stderr, flush=True)
        times = []
        wire = []
        dist.barrier()
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(len(xt), (batch * world,), generator=g)[rank::world]
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(xt[idx]), yt[idx]).backward()
            opt.step()
            hook.after_optimizer_step(ddp)
            sched.step()
            times.append(time.perf_counter() - t0)
            if hook.metrics.last is not None:
                wire.append(hook.metrics.last.wire_bytes)
        with torch.no_grad():
            acc = float((ddp.module(xv).argmax(1) == yv).float().mean())
        tail = times[steps // 2 :]
        results[name] = {
            "step_s": statistics.median(tail),
            "accuracy": acc,
            "wire_mb_per_step": statistics.median(wire[steps // 2 :]) / 1e6 if wire else 0.0,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        }
        dist.barrier()
    return results


WORKERS = {
    "allreduce": worker_allreduce,
    "hierarchical": worker_hierarchical,
    "train": worker_train,
}


# --------------------------------------------------------------------------- driver

TRAIN_CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"type": "none"},
    "fp16": {"type": "fp16"},
    "powersgd": {"type": "powersgd", "rank": 4, "start_iter": 10},
    "topk_1pct": {"type": "topk", "ratio": 0.01, "momentum": 0.9, "warmup_steps": 10},
    "qsgd_8bit": {"type": "qsgd", "bits": 8, "warmup_steps": 5},
}


def _log(msg: str) -> None:
    print(msg, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from orchestrator.topology import NodeInfo, interleaved_order, topology_order

    cluster = Cluster(rate=args.rate)
    atexit.register(cluster.close)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(1))
    try:
        cluster.build()
        _log(f"cluster: 4 nodes, racks {RACK_OF_NODE}, inter-rack link tbf {args.rate} each way")
        nodes = [
            NodeInfo(f"n{i}", 1, {"zone": "z", "rack": f"r{rack}", "host": f"h{i}"})
            for i, rack in enumerate(RACK_OF_NODE)
        ]
        ordered = topology_order(reversed(nodes))
        interleaved = interleaved_order(ordered)
        to_index = {f"n{i}": i for i in range(len(nodes))}
        topo_nodes = [to_index[i] for i in ordered.node_ids]
        inter_nodes = [to_index[i] for i in interleaved.node_ids]
        common = {"size_mb": args.size_mb, "repeats": args.repeats}
        _log(f"ring order topology-aware {topo_nodes} vs interleaved {inter_nodes}")
        inter = _launch(cluster, inter_nodes, "allreduce", common)
        _log(f"  interleaved: {inter['seconds']:.2f} s for {args.size_mb} MB")
        topo = _launch(cluster, topo_nodes, "allreduce", common)
        _log(f"  topology:    {topo['seconds']:.2f} s for {args.size_mb} MB")
        placement = [n for n in topo_nodes for _ in range(2)]
        hier = _launch(cluster, placement, "hierarchical", common)
        _log(f"  2 ranks/node: flat {hier['flat_s']:.2f} s")
        _log(f"  2 ranks/node: hierarchical {hier['hierarchical_s']:.2f} s")
        train_args = {
            "configs": TRAIN_CONFIGS,
            "steps": args.steps,
            "hidden": args.hidden,
            "batch": args.batch,
        }
        train = _launch(cluster, topo_nodes, "train", train_args)
        for name, r in train.items():
            _log(
                f"  train {name:10s} step {r['step_s'] * 1000:8.1f} ms  acc {r['accuracy']:.4f}  "
                f"wire {r['wire_mb_per_step']:.2f} MB/step  ({r['params_m']:.2f} M params)"
            )
    finally:
        cluster.close()

    compressors = ("powersgd", "topk_1pct", "qsgd_8bit")
    best = min(compressors, key=lambda k: train[k]["step_s"])
    fp32, fp16 = train["fp32"], train["fp16"]
    return {
        "allreduce_mb": args.size_mb,
        "inter_rack_rate": args.rate,
        "allreduce_interleaved_s": round(inter["seconds"], 3),
        "allreduce_topology_s": round(topo["seconds"], 3),
        "topology_speedup_x": round(inter["seconds"] / topo["seconds"], 2),
        "allreduce_flat_2perNode_s": round(hier["flat_s"], 3),
        "allreduce_hierarchical_2perNode_s": round(hier["hierarchical_s"], 3),
        "hierarchical_speedup_x": round(hier["flat_s"] / hier["hierarchical_s"], 2),
        **{f"step_{k}_ms": round(v["step_s"] * 1000, 1) for k, v in train.items()},
        **{f"accuracy_{k}_pct": round(100 * v["accuracy"], 2) for k, v in train.items()},
        "best_compressor": best,
        "best_vs_fp32_speedup_x": round(fp32["step_s"] / train[best]["step_s"], 2),
        "best_vs_fp16_speedup_x": round(fp16["step_s"] / train[best]["step_s"], 2),
        "best_accuracy_gap_pct_points": round(
            100 * (fp32["accuracy"] - train[best]["accuracy"]), 2
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=100.0)
    parser.add_argument("--rate", default="200mbit", help="inter-rack tbf rate, each way")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-args", default="{}", help=argparse.SUPPRESS)
    smoke = {"size_mb": 1.0, "rate": "1gbit", "repeats": 1, "steps": 12, "hidden": 64, "batch": 4}
    args = parse(parser, smoke)
    if args.worker:
        import torch.distributed as dist

        result = WORKERS[args.worker](json.loads(args.worker_args))
        dist.barrier()  # no rank leaves while a peer is still in the last collective
        print(json.dumps(result), flush=True)
        exit_now()
    reason = _can_build()
    if reason is not None:
        _log(f"SKIPPED: network namespaces unavailable ({reason})")
        print(result_line({"skipped": True, "reason": reason}, args.smoke))
        return 0
    print(result_line(run(args), args.smoke))
    return 0


if __name__ == "__main__":
    sys.exit(main())
